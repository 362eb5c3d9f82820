"""Tiny random hybrid linear-attention checkpoints (Qwen3-Next, Qwen3.5 dense and MoE),
written by transformers itself, and the published multimodal Qwen3.5 folder layout.

Every model has linear (Gated DeltaNet) and full attention layers: Qwen3-Next alternates
them with MoE (4 experts top-2 and a shared expert) everywhere, Qwen3.5 has three linear
layers then a full one. Value heads are twice the key heads (the grouped delta rule), RoPE
covers a quarter of each head (partial rotary), and weights are large enough that greedy
output varies.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

import torch

from tests.gpu_worker.model_utils import BOS_ID, EOS_ID, UNK_ID, save_tiny_tokenizer

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=UNK_ID, tie_word_embeddings=False, intermediate_size=96,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48)

# name -> (transformers config class, model class, config kwargs)
HYBRIDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, **_MOE,
        layer_types=["linear_attention", "full_attention"] * 2)),
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(num_hidden_layers=4)),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, **_MOE)),
}


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            # Slow decays (exp(-A softplus(.)) of 0.9-0.995 a token): the state remembers
            # far back, so a state lost or restored wrong changes the greedy tokens.
            p.copy_(torch.rand(p.shape, generator=gen) * 3.0 - 6.0)
        elif p.ndim == 1:  # norms (1 + w), dt_bias
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (0.0 if "layernorm" in name
                                                                  or "norm.weight" == name[-11:]
                                                                  else 1.0))
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / math.sqrt(p.shape[-1]))


def hybrid_checkpoint(root: str | os.PathLike[str], family: str, *, seed: int = 0,
                      tokenizer: bool = False, **overrides: Any) -> str:
    """Build, randomise and save a tiny `family` checkpoint (float32); its folder."""
    import transformers

    config_name, model_name, kwargs = HYBRIDS[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _randomize(model, seed)
    path = tempfile.mkdtemp(prefix=f"tiny-{family}-", dir=os.fspath(root))
    model.eval().save_pretrained(path)
    if tokenizer:
        save_tiny_tokenizer(path, config.vocab_size)
    return path


def as_multimodal(text_path: str, root: str | os.PathLike[str]) -> str:
    """The published Qwen3.5 folder layout of a text-only Qwen3.5 checkpoint: a top-level
    config with `text_config`, the weights under model.language_model.*, and tensors of a
    vision tower and an MTP head that the server must ignore."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(text_path, "config.json")) as f:
        text = json.load(f)
    arch = {"Qwen3_5ForCausalLM": "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForConditionalGeneration"}[
        text["architectures"][0]]
    text.pop("architectures")
    cfg = {"architectures": [arch], "model_type": text["model_type"].removesuffix("_text"),
           "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    weights = load_file(os.path.join(text_path, "model.safetensors"))
    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
           for k, v in weights.items()}
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    out["mtp.fc.weight"] = torch.zeros(4, 4)
    path = tempfile.mkdtemp(prefix="tiny-multimodal-", dir=os.fspath(root))
    save_file(out, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


_cache: dict[str, str] = {}


def checkpoint(root: str | os.PathLike[str], family: str) -> str:
    """`hybrid_checkpoint`, built once per test run for each family."""
    if family not in _cache:
        _cache[family] = hybrid_checkpoint(root, family)
    return _cache[family]
