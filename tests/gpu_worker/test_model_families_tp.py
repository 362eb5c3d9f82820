"""The new families at tensor parallel size 2 (two ranks joined by gloo on 127.0.0.1).

The two-rank job (`tp_job.py`) loads each family's shards: experts split along their
intermediate dimension with the router replicated, Phi-3's fused qkv_proj / gate_up_proj
read in per-rank row ranges, Gemma 3's sandwich norms applied after the all-reduces. Greedy
continuations equal HF `generate()`, prefill logits equal TP=1 (to 1e-5 of their scale), one
decode forward per family runs under the host-sync guard, and a Qwen3-MoE serving run through
ModelRunner.execute (K=8 per step, K=1 after the plan) equals HF with rank 1 in lockstep.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu_worker import tp_job
from tests.gpu_worker.family_utils import FAMILIES, checkpoint
from tests.gpu_worker.runner_driver import hf_greedy

RUNNER_FAMILY = "qwen3-moe"


@pytest.fixture(scope="module")
def paths(ckpt_root: Any) -> dict[str, str]:
    return {f: checkpoint(ckpt_root, f, published=True) for f in FAMILIES}


@pytest.fixture(scope="module")
def ranks(paths: dict[str, str], tmp_path_factory: pytest.TempPathFactory
          ) -> list[dict[str, Any]]:
    return tp_job.launch({"models": paths, "runner": paths[RUNNER_FAMILY],
                          "served": False},
                         tmp_path_factory.mktemp("tp-families-out"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_and_logits_equal_tp1(ranks: list[dict[str, Any]],
                                               paths: dict[str, str], family: str) -> None:
    got = ranks[0]["models"][family]
    assert got["kv_heads"] == 1  # 2 kv heads over 2 ranks
    for prompt, out in zip(got["prompts"], got["greedy"], strict=True):
        assert out == hf_greedy(paths[family], prompt, tp_job.GREEDY_TOKENS)
    assert ranks[1]["models"][family]["greedy"] == got["greedy"]
    torch.set_num_threads(1)
    tp1 = tp_job.model_outputs(paths[family], None)["logits"]
    scale = tp1.abs().max().item()
    assert (got["logits"] - tp1).abs().max().item() <= 1e-5 * scale
    assert torch.isfinite(got["guarded"]).all()


@pytest.mark.parametrize("mode", ["async_k8", "sync_k1"])
def test_moe_serving_run_equals_hf(ranks: list[dict[str, Any]], paths: dict[str, str],
                                   mode: str) -> None:
    got = ranks[0][mode]
    for rid in (0, 1, 3):  # the greedy requests
        assert got["out"][rid] == hf_greedy(paths[RUNNER_FAMILY], got["prompts"][rid]), rid
    assert ranks[1][mode]["out"] == got["out"]
    assert len(set(got["out"][2])) > 5, "the sampled request should vary"
