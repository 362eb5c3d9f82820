"""Tiny random hybrid linear-attention checkpoints (Qwen3-Next, Qwen3.5 dense and MoE),
written by transformers itself (the multimodal Qwen3.5 folders: tests/vl_utils.py).

Every model has linear (Gated DeltaNet) and full attention layers: Qwen3-Next alternates
them with MoE (4 experts top-2 and a shared expert) everywhere, Qwen3.5 has three linear
layers then a full one. Value heads are twice the key heads (the grouped delta rule), RoPE
covers a quarter of each head (partial rotary), and weights are large enough that greedy
output varies.
"""
from __future__ import annotations

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


def slow_decay_logs(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Gated DeltaNet `A_log` values of slow decays (exp(-A softplus(.)) of 0.9-0.995 a
    token): the state remembers far back, so a state lost or restored wrong changes the
    greedy tokens."""
    return torch.rand(shape, generator=gen) * 3.0 - 6.0


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(slow_decay_logs(p.shape, gen))
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


_cache: dict[str, str] = {}


def checkpoint(root: str | os.PathLike[str], family: str) -> str:
    """`hybrid_checkpoint`, built once per test run for each family."""
    if family not in _cache:
        _cache[family] = hybrid_checkpoint(root, family)
    return _cache[family]
