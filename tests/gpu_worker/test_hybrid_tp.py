"""Hybrid models at tensor parallel size 2 (two ranks joined by gloo on 127.0.0.1): each rank
holds whole key heads of every Gated DeltaNet layer with their value heads (its part of the
projections, the convolution's channels, the decay parameters and its own recurrent states),
its query heads of the gated attention, and its part of every expert and the shared expert.
A serving run through `ModelRunner.execute` (greedy, seeded sampled, logprob and
prompt-logprob requests; K=8 per step and K=1 after the plan) equals HF with rank 1 in
lockstep."""
from __future__ import annotations

from typing import Any

import pytest

from tests.gpu_worker import tp_job
from tests.gpu_worker.hybrid_utils import checkpoint
from tests.gpu_worker.runner_driver import hf_greedy

FAMILIES = ["qwen3-next", "qwen3.5"]  # interleaved in_proj_qkvz; in_proj_qkv read in parts


@pytest.fixture(scope="module")
def paths(ckpt_root: Any) -> dict[str, str]:
    return {f: checkpoint(ckpt_root, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def ranks(paths: dict[str, str], tmp_path_factory: pytest.TempPathFactory
          ) -> list[dict[str, Any]]:
    return tp_job.launch({"hybrid": paths}, tmp_path_factory.mktemp("tp-hybrid-out"))


@pytest.mark.parametrize("mode", ["async_k8", "sync_k1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_serving_run_equals_hf(ranks: list[dict[str, Any]], paths: dict[str, str],
                               family: str, mode: str) -> None:
    got = ranks[0][family][mode]
    for rid in (0, 1, 3):  # the greedy requests
        assert got["out"][rid] == hf_greedy(paths[family], got["prompts"][rid]), rid
    assert ranks[1][family][mode]["out"] == got["out"]
    assert len(set(got["out"][2])) > 5, "the sampled request should vary"
