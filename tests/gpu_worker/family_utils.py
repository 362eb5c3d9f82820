"""Tiny random checkpoints of the newer families, written by transformers itself.

    path = family_checkpoint(root, "gemma3")                   # transformers 5's config.json
    path = family_checkpoint(root, "gemma3", published=True)   # the keys the Hub models use

Shapes are tiny; each family is set up so that what sets it apart is exercised: Qwen3-MoE
has 8 experts top-2 renormalised, an explicit head_dim and a dense layer (`mlp_only_layers`);
Mixtral 8 experts top-2; Gemma 3 alternates sliding (a 20-token window, shorter than the test
prompts plus their output) and global layers, with a local RoPE base, linear scaling on the
global one, a query scale and capped logits; Phi-3 has LongRoPE over half of each head
(partial rotary) with an original context of 64 tokens. `published=True` rewrites
config.json the way the published checkpoints spell it (`rope_scaling` + `rope_theta`,
`num_experts`, `sliding_window_pattern`, `rope_local_base_freq`, Phi-3's `rope_scaling`
with `type: longrope`), which transformers and Tandem must read to the same model.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

import torch

from tests.gpu_worker.model_utils import BOS_ID, EOS_ID, UNK_ID, save_tiny_tokenizer

_COMMON: dict[str, Any] = dict(vocab_size=512, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=1024,
                               bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=UNK_ID,
                               tie_word_embeddings=False)
PHI3_ORIGINAL = 64
PHI3_SHORT = [1.0, 1.25, 1.5, 2.0]
PHI3_LONG = [1.0, 3.0, 9.0, 25.0]
GEMMA3_WINDOW = 20

# name -> (transformers config class, model class, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        rope_theta=10000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=64, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None, rope_theta=10000.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=128, num_hidden_layers=4, head_dim=32, sliding_window=GEMMA3_WINDOW,
        sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=4.0,
        rope_theta=20000.0, rope_local_base_freq=500.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512,
        original_max_position_embeddings=PHI3_ORIGINAL, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG},
        rope_theta=10000.0)),
}


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
    """Large weights so greedy output varies (HF's std-0.02 init repeats one token); fan-in
    is the last dimension, which also holds for stacked [E, out, in] experts."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:  # norms (Gemma's scale by 1 + w: twice as much, which it needs)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + 1.0)
        elif "embed_tokens" in name or "lm_head" in name:
            # Gemma multiplies embeddings by sqrt(hidden): keep them at the scale of what the
            # layers add, or the (tied) head would just predict the input token again.
            std = p.shape[-1] ** -0.5 if gemma else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / math.sqrt(p.shape[-1]))


def family_checkpoint(root: str | os.PathLike[str], family: str, *, published: bool = False,
                      tokenizer: bool = False, seed: int = 0, **overrides: Any) -> str:
    """Build, randomise and save a tiny `family` checkpoint (float32); its folder."""
    import transformers

    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _randomize(model, seed, gemma=family == "gemma3")
    path = tempfile.mkdtemp(prefix=f"tiny-{family}-", dir=os.fspath(root))
    model.eval().save_pretrained(path)
    if published:
        publish_config(path, family, {**kwargs, **overrides})
    if tokenizer:
        save_tiny_tokenizer(path, config.vocab_size)
    return path


def publish_config(path: str, family: str, kwargs: dict[str, Any]) -> None:
    """Rewrite config.json with the keys the published checkpoints of `family` use."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters", None) or {}
    if family == "gemma3":
        for key in ("layer_types", "_sliding_window_pattern"):
            cfg.pop(key, None)
        full = rope["full_attention"]
        cfg.update(rope_theta=full["rope_theta"], rope_scaling=kwargs.get("rope_scaling"),
                   rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                   sliding_window_pattern=kwargs["sliding_window_pattern"])
    elif family == "phi3":
        cfg.update(rope_theta=rope["rope_theta"], rope_scaling={
            "type": "longrope", "long_factor": rope["long_factor"],
            "short_factor": rope["short_factor"]})
    else:
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["rope_scaling"] = None
        if family == "qwen3-moe":  # the Hub's spelling; transformers 5 writes num_local_experts
            cfg["num_experts"] = cfg.pop("num_local_experts")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


_cache: dict[tuple[str, bool, bool], str] = {}


def checkpoint(root: str | os.PathLike[str], family: str, published: bool = False,
               tokenizer: bool = False) -> str:
    """`family_checkpoint`, built once per test run for each (family, layout, tokenizer)."""
    key = (family, published, tokenizer)
    if key not in _cache:
        _cache[key] = family_checkpoint(root, family, published=published, tokenizer=tokenizer)
    return _cache[key]
