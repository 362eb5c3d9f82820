"""`tandem serve --tensor-parallel-size 2` over real processes: two gpu worker ranks (gloo).

On this 2-core machine the servers run with `--reserved-cpus 0`: the ranks float over both
cores with one torch thread each, rather than sharing the single core `--reserved-cpus 1`
would leave the gpu workers.

* K=8 async: concurrent greedy streams equal HF `generate()`; seeded sampled streams equal a
  TP=1 server's, with greedy ones in the same batches;
* K=1 sync: greedy streams equal HF (on the two-"host" server below that stops cleanly);
* guided requests (their table sent to every rank once) equal HF under the same constraint;
* killing either rank mid-stream, or a rank hanging, meets the failure contract;
* two "hosts" on this one: rank 1 started on its own (`run-role gpu-worker --node-rank 1`),
  its plans over TCP; it stops with the server, and the server fails when it dies.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem_serve.ipc.process import CLI
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import ROOT, Server, free_port, running
from tests.e2e.test_failures import (
    EXIT_WITHIN,
    FAULT_PLAN,
    assert_clean,
    assert_failed,
    hung_and_stopped,
    open_streams,
    wait_exit,
)
from tests.e2e.test_greedy_parity import PROMPTS, stream_text
from tests.e2e.test_guided import NUM, guided
from tests.e2e.test_guided import PROMPTS as GUIDED_PROMPTS
from tests.e2e.test_guided import reference as guided_reference
from tests.e2e.test_guided import stream as guided_stream
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

TP = ("--tensor-parallel-size", "2", "--reserved-cpus", "0")
SAMPLED = [("Once upon a time", 7), ("The quick brown fox", 1234), ("Tandem runs", 99)]


@pytest.fixture(scope="module")
def hf_outputs(tiny_model_dir: pathlib.Path) -> dict[str, str]:
    return dict(zip([t for t, _ in PROMPTS], hf_greedy(tiny_model_dir, PROMPTS), strict=True))


@pytest.fixture(scope="module")
def tp2(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), *TP)


def sampled(server: Server, text: str, seed: int) -> str:
    opts = GenerateOptions(max_new_tokens=24, min_new_tokens=24, sample=True, temperature=0.8,
                           top_k=50, top_p=0.9, seed=seed)
    return "".join(r.text for r in server.client.stream(text, opts))


def mixed_load(server: Server) -> tuple[list[str], list[str]]:
    """Greedy and seeded sampled streams, all at once: (greedy texts, sampled texts)."""
    with ThreadPoolExecutor(len(PROMPTS) + len(SAMPLED)) as pool:
        greedy = [pool.submit(stream_text, server, *p) for p in PROMPTS]
        drawn = [pool.submit(sampled, server, *s) for s in SAMPLED]
        return [g.result()[0] for g in greedy], [d.result() for d in drawn]


def test_ranks_run_as_their_own_processes(tp2: Server) -> None:
    roles = tp2.role_pids()
    assert {"gpu-worker 0/2", "gpu-worker 1/2"} <= roles.keys()
    assert "gpu-worker" not in roles


def test_greedy_equals_hf_and_seeded_sampling_equals_tp1(
        tp2: Server, tiny_model_dir: pathlib.Path, hf_outputs: dict[str, str]) -> None:
    greedy, drawn = mixed_load(tp2)
    for (text, _), got in zip(PROMPTS, greedy, strict=True):
        assert got == hf_outputs[text], text
    single = Server(str(tiny_model_dir), "--reserved-cpus", "0")  # TP=1
    try:
        single.wait_ready()
        _, reference = mixed_load(single)
    finally:
        assert single.stop() == 0
    assert drawn == reference
    assert len(set(drawn)) == len(drawn)  # different seeds, different streams


def test_guided_requests_equal_hf_on_every_rank(tp2: Server,
                                                tiny_model_dir: pathlib.Path) -> None:
    """A guided request carries its constraint's id; the table reaches rank 1 over the plan
    channel once, in the plan that first uses it.  Greedy outputs under it equal HF's, in a
    first wave and in a second that reuses the table the ranks hold."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # tiny forwards beside a server on a shared machine
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = GUIDED_PROMPTS[:2]
    want = {t: guided_reference(tiny_model_dir, hf, NUM, t) for t in texts}
    for _ in range(2):
        with ThreadPoolExecutor(len(texts)) as pool:
            got = list(pool.map(lambda t: guided_stream(tp2, t, guided(regex=NUM)), texts))
        for text, r in zip(texts, got, strict=True):
            assert (r.text, r.generated_token_count) == want[text], text


@pytest.mark.parametrize("role", ["gpu-worker 1/2", "gpu-worker 0/2"])
def test_killing_a_rank_fails_streams_and_the_server_exits(tiny_model_dir: pathlib.Path,
                                                           role: str) -> None:
    server = Server(str(tiny_model_dir), *TP, "--num-scheduler-steps", "2")
    try:
        server.wait_ready()
        pid = server.role_pids()[role]
        streams = open_streams(server)
        died = time.time()
        os.kill(pid, signal.SIGKILL)
        rc, exited = wait_exit(server)
        assert_failed(streams, died, role, "killed by SIGKILL", "shutting down")
        assert rc != 0
        assert exited - died < EXIT_WITHIN, f"exit {exited - died:.2f} s after the death"
    finally:
        server.stop(signal.SIGKILL)
    assert_clean(server)


def test_a_hung_rank_is_dumped_and_the_set_is_stopped(tiny_model_dir: pathlib.Path) -> None:
    """Rank 1 stops answering: rank 0 waits in a collective, the plan outlives the step
    timeout, and the launcher dumps every rank's stacks and ends the server."""
    step_timeout = 3.0
    server = Server(str(tiny_model_dir), *TP, "--num-scheduler-steps", "2", "--step-timeout",
                    str(step_timeout),
                    env={"TANDEM_FAULT": f"gpu-worker 1/2:plan={FAULT_PLAN}:hang"})
    try:
        server.wait_ready()
        log = hung_and_stopped(server, step_timeout)
        assert re.search(r'File ".*ipc/faults\.py", line \d+ in _fire', log), log[-3000:]
        # Rank 0's stack too: it is the one waiting in the all-reduce.
        assert re.search(r'File ".*gpu_worker/parallel\.py", line \d+ in all_reduce', log), \
            log[-3000:]
    finally:
        server.stop(signal.SIGKILL)
    assert_clean(server)


def start_node(model: str, addr: str) -> subprocess.Popen[str]:
    """The second host's rank, as an operator starts it there."""
    return subprocess.Popen(
        [*CLI, "run-role", "gpu-worker", "--model", model,
         "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", addr, "--reserved-cpus", "0", "--torch-threads", "1",
         "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def greedy_equals_hf(server: Server, hf_outputs: dict[str, str]) -> None:
    """Every prompt at once: texts equal HF's, each exactly its token count long."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: stream_text(server, *p), PROMPTS))
    for (text, n), (got, count) in zip(PROMPTS, results, strict=True):
        assert (got, count) == (hf_outputs[text], n), text


# The clean-stop case serves K=1 sync (`--no-async-postproc`) with every prompt at once: the
# TP sync K=1 parity check, on a server this module starts anyway (a server start is ~10 s of
# a 2-core CI run); the other keeps the default K=8 async.
ENDINGS = {"server stops": ("--num-scheduler-steps", "1", "--no-async-postproc"),
           "remote rank dies": ()}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_rank_on_another_host(tiny_model_dir: pathlib.Path, hf_outputs: dict[str, str],
                                ending: str) -> None:
    addr = f"127.0.0.1:{free_port()}"
    node = start_node(str(tiny_model_dir), addr)
    server = Server(str(tiny_model_dir), "--tensor-parallel-size", "2", "--nnodes", "2",
                    "--node-rank", "0", "--dist-init-addr", addr, "--reserved-cpus", "0",
                    "--torch-threads", "1", *ENDINGS[ending])
    try:
        server.wait_ready()
        assert "gpu-worker 0/2" in server.role_pids()
        assert "gpu-worker 1/2" not in server.role_pids()  # not the launcher's child
        if ending == "server stops":
            greedy_equals_hf(server, hf_outputs)
            assert server.stop() == 0
            assert node.wait(10) == 0, node.stderr.read() if node.stderr else ""
        else:
            text, n = PROMPTS[0]
            assert stream_text(server, text, n) == (hf_outputs[text], n)
            node.kill()
            died = time.time()
            rc, exited = wait_exit(server)
            assert rc != 0 and exited - died < EXIT_WITHIN
            # Rank 0 saw the plan channel close (the rank was idle, in no collective).
            assert re.search(r"gpu-worker 0/2 process .* failed: RankLost: a gpu worker rank "
                             r"on another host disconnected", server.log())
    finally:
        server.stop(signal.SIGKILL)
        if node.poll() is None:
            node.kill()
        node.wait()
    assert_clean(server)
