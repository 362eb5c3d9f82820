"""Tensor parallelism on CUDA: two ranks joined by NCCL, one GPU each (skipped below two).

The CPU tests (`test_tensor_parallel.py`) check the sharding and the serving path with gloo;
these check what only a GPU has: NCCL collectives ordered on the stream, decode steps that
replay CUDA graphs with the all-reduces and the logits gather captured in them, a decode
forward under CUDA's sync debug mode (no collective syncs the host), and parity with TP=1
on the same device and with HF.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu_worker import tp_job
from tests.gpu_worker.model_utils import make_tiny_checkpoint
from tests.gpu_worker.runner_driver import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", dict(seed=5)),
    "llama-single-kv-head-tied": ("llama", dict(num_key_value_heads=1,
                                                tie_word_embeddings=True, seed=6)),
    "qwen3-qk-norm": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                    seed=2)),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-gpu-ckpts")
    return {name: make_tiny_checkpoint(root, arch, tokenizer=False, **kw)
            for name, (arch, kw) in ARCHS.items()}


@pytest.fixture(scope="module")
def ranks(paths: dict[str, str], tmp_path_factory: pytest.TempPathFactory
          ) -> list[dict[str, Any]]:
    return tp_job.launch({"models": paths, "runner": paths["llama-gqa"]},
                         tmp_path_factory.mktemp("tp-gpu-out"), device="cuda")


@pytest.mark.parametrize("name", list(ARCHS))
def test_nccl_shards_equal_tp1_and_hf(ranks: list[dict[str, Any]], paths: dict[str, str],
                                      name: str) -> None:
    tp1 = tp_job.model_outputs(paths[name], None, "cuda")
    got = ranks[0]["models"][name]
    scale = tp1["logits"].abs().max().item()
    assert (got["logits"] - tp1["logits"]).abs().max().item() <= 1e-5 * scale
    for prompt, out in zip(got["prompts"], got["greedy"], strict=True):
        assert out == hf_greedy(paths[name], prompt, tp_job.GREEDY_TOKENS)
    assert torch.isfinite(got["guarded"]).all()  # ran under CUDA's sync debug mode
    assert ranks[1]["models"][name]["greedy"] == got["greedy"]


@pytest.mark.parametrize("mode", ["async_k8", "sync_k1"])
def test_graph_decode_with_collectives_equals_tp1(ranks: list[dict[str, Any]],
                                                  paths: dict[str, str], mode: str) -> None:
    got = ranks[0][mode]
    assert got["graphs"], "decode should have replayed CUDA graphs"
    k, per_step = (8, True) if mode == "async_k8" else (1, False)
    ref = tp_job.runner_outputs(paths["llama-gqa"], None, k, per_step, "cuda")
    assert got["out"] == ref["out"]
    for rid in (0, 1, 3):
        assert got["out"][rid] == hf_greedy(paths["llama-gqa"], got["prompts"][rid])
    assert ranks[1][mode]["out"] == got["out"]
