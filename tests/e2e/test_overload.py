"""Overload: a burst of 10x what admission control admits, all released at once.

The excess gets RESOURCE_EXHAUSTED before any response message, naming the limit; every
admitted request completes with its full output, equal to HF's; nothing is lost.  TTFT of
the admitted requests is printed, never asserted (`tandem bench robustness` reports it).
"""
from __future__ import annotations

import pathlib
from contextlib import contextmanager

import pytest

from tandem_serve.harness.clients import burst, overload_jobs, summarize_overload
from tandem_serve.harness.server import wait_idle
from tests.e2e.server import running
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

QUEUED, RUNNING, TOKENS = 4, 4, 24
PROMPTS = ["Once upon a time", "The quick brown fox", "River stone cloud", "Seven lights"]


def test_a_burst_of_ten_times_the_admission_limit(fast_model_dir: pathlib.Path) -> None:
    want = dict(zip(PROMPTS, hf_greedy(fast_model_dir, [(p, TOKENS) for p in PROMPTS]),
                    strict=True))
    jobs = overload_jobs(10 * (QUEUED + RUNNING), TOKENS, PROMPTS)
    with contextmanager(running)(str(fast_model_dir), "--max-queued-requests", str(QUEUED),
                                 "--max-num-seqs", str(RUNNING), "--num-scheduler-steps",
                                 "4") as server:
        outcomes = burst(f"127.0.0.1:{server.port}", jobs)
        stats = wait_idle(server.client)
    report = summarize_overload(outcomes, TOKENS)
    print(f"\noverload: {report}")
    assert report.lost == 0, report.lost_examples
    assert report.admitted + report.rejected == len(jobs)
    assert report.admitted >= QUEUED and report.rejected > 0
    assert f"max_queued_requests={QUEUED}" in report.rejection
    for (text, _), out in zip(jobs, outcomes, strict=True):
        if out.code == "OK":  # complete, and the same text as alone
            assert (out.tokens, out.text) == (TOKENS, want[text])
    assert (stats.num_free_blocks, stats.num_running) == (stats.num_total_blocks, 0)
