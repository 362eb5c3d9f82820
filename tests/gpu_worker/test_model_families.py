"""Qwen3-MoE, Mixtral, Gemma 3 and Phi-3 against HF `generate()` (greedy, float32).

Checkpoints are random tiny ones written by transformers (`family_utils`): the model tests
read them as transformers 5 writes config.json, the runner tests as the published models
spell it. Through `ModelRunner.execute` every family runs a busy batch (requests joining,
a chunked prefill, a preemption and resume, a prefix shared with another request's blocks)
at K=8 publishing per step and at K=1 publishing after the plan (the sync baseline), with
the K-step loop under the host-sync guard (the MoE dispatch included).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.loader import load_model
from tests.gpu_worker.family_utils import FAMILIES, PHI3_ORIGINAL, checkpoint
from tests.gpu_worker.model_utils import PagedDriver, random_prompts
from tests.gpu_worker.runner_driver import (
    NEW_TOKENS,
    Driver,
    hf_greedy,
    make_runner,
    run_busy_batch,
)
from tests.gpu_worker.sync_guard import forbid_host_sync

CPU = torch.device("cpu")
# Phi-3's prompts either stay within its original context for their whole output (short
# factors) or start beyond it (long factors): see gpu_worker.models.rope.
LENGTHS = [1, 33, 70, 9, 40, 100]


def _varied(outs: list[list[int]]) -> None:
    """Parity only means something if the model's output varies."""
    assert max(len(set(o)) for o in outs) >= 8


@pytest.mark.parametrize("family", list(FAMILIES))
def test_published_and_transformers_5_configs_read_alike(ckpt_root: Path, family: str) -> None:
    """Both spellings of config.json give one ModelArgs, and transformers reads them to the
    same model too (one forward, same logits): the runner tests' parity on the published
    layout and the model tests' on the other then judge the same thing."""
    from transformers import AutoModelForCausalLM

    paths = [checkpoint(ckpt_root, family, published=p) for p in (False, True)]
    configs = [json.loads(Path(p, "config.json").read_text()) for p in paths]
    assert configs[0] != configs[1]
    args = [ModelArgs.from_hf_config(c) for c in configs]
    assert args[0] == args[1]
    ids = torch.tensor([random_prompts([90], 512, seed=1)[0]])
    logits = []
    for p in paths:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_family_settings_are_read(ckpt_root: Path) -> None:
    moe, mixtral, gemma, phi = (ModelArgs.from_hf_config(json.loads(
        Path(checkpoint(ckpt_root, f, published=True), "config.json").read_text()))
        for f in FAMILIES)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)
    assert moe.moe_layers == (True, False, True) and moe.head_dim == 32
    assert (mixtral.num_experts, mixtral.moe_layers, mixtral.norm_topk_prob) == (
        8, (True, True), True)
    assert gemma.sliding_windows == (20, None, 20, None)
    assert (gemma.local_rope_theta, gemma.rope_theta, gemma.rope_type) == (500.0, 20000.0,
                                                                            "linear")
    assert gemma.attn_scale == 24 ** -0.5 and gemma.tie_word_embeddings
    assert phi.rotary_dim == 8 and phi.head_dim == 16 and phi.rope_type == "longrope"
    assert phi.rope_original_max_position_embeddings == PHI3_ORIGINAL
    # sqrt(1 + ln(s) / ln(original)) with s = 512 / 64
    assert phi.rope_attention_factor == pytest.approx((1 + 3 / 6) ** 0.5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_greedy_parity(ckpt_root: Path, family: str) -> None:
    """One batched prefill, then batched decode with masked rows, as the model tests do."""
    path = checkpoint(ckpt_root, family)
    model = load_model(path, torch.float32, CPU)
    prompts = random_prompts(LENGTHS, 512, seed=3)
    driver = PagedDriver(model, num_blocks=120, block_size=16, seed=1, max_seq_len_slack=5)
    ours = driver.generate([driver.new_seq(p) for p in prompts], NEW_TOKENS,
                           extra_masked_rows=2)
    want = [hf_greedy(path, p) for p in prompts]
    assert ours == want
    _varied(want)


@pytest.mark.parametrize("k, per_step", [(8, True), (1, False)], ids=["async-k8", "sync-k1"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_runner_busy_batch_preemption_and_prefix(ckpt_root: Path, family: str, k: int,
                                                 per_step: bool) -> None:
    path = checkpoint(ckpt_root, family, published=True)
    runner = make_runner(path)
    # The scheduler turns prefix caching off past this (scheduler.main.prefix_caching).
    assert runner.long_rope_from == (PHI3_ORIGINAL if family == "phi3" else 0)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=len(family))
    prompts = run_busy_batch(d, k, per_step)
    want = [hf_greedy(path, q) for q in prompts]
    assert [d.reqs[r].out for r in range(6)] == want
    _varied(want)
