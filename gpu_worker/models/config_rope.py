"""RoPE settings from a config.json, as transformers reads them.

Three layouts reach us: transformers >= 5 writes `rope_parameters` (with `rope_theta` inside,
and for Gemma 3 one dict per layer type); older files, and most published checkpoints, use
`rope_scaling` (`type` or `rope_type`) plus a top-level `rope_theta` (Gemma 3 adds
`rope_local_base_freq` for its sliding layers). Anything we do not implement is a ValueError
naming the key, never an approximation.

Torch-free, like `config`: the launcher parses the config before any process starts.
"""
from __future__ import annotations

import math
from typing import Any

from tandem_serve.gpu_worker.models.hybrid.config import HYBRID_ARCHITECTURES

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "longrope")
_GEMMA3 = "Gemma3ForCausalLM"
_PHI3 = "Phi3ForCausalLM"
# Families that rotate only part of each head (`partial_rotary_factor`).
_PARTIAL_ROTARY = (_PHI3, *HYBRID_ARCHITECTURES)
# transformers' class defaults where a config.json leaves the theta out.
_GEMMA3_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0


def rope_fields(cfg: dict[str, Any], arch: str, head_dim: int, max_pos: int) -> dict[str, Any]:
    """The ModelArgs rope fields of `cfg` (rope_theta, rope_type, factors, rotary_dim, ...)."""
    if arch == _GEMMA3:
        full, local = _gemma3_ropes(cfg)
        out = _one_rope(full, cfg, arch, head_dim, max_pos, _GEMMA3_GLOBAL_THETA)
        local_type = local.get("rope_type") or local.get("type") or "default"
        if local_type != "default":
            raise ValueError(f"unsupported rope type {local_type!r} for the sliding layers "
                             "(rope_parameters.sliding_attention); supported: default")
        out["local_rope_theta"] = float(local.get("rope_theta") or _LOCAL_THETA)
        return out
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    return _one_rope(rope, cfg, arch, head_dim, max_pos, 10000.0)


def _gemma3_ropes(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope dicts: transformers >= 5 keys them by layer type; published
    configs give the global one as `rope_scaling` + `rope_theta` and the local theta as
    `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    full = dict(cfg.get("rope_scaling") or params)
    local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq")}
    return full, local


def _one_rope(rope: dict[str, Any], cfg: dict[str, Any], arch: str, head_dim: int,
              max_pos: int, default_theta: float) -> dict[str, Any]:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if arch == _PHI3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # what transformers' Phi3Config makes of these old names
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} (rope_scaling / "
                         f"rope_parameters); supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "longrope" and arch != _PHI3:
        # transformers switches Phi-3 to the long factors by recomputing the sequence (see
        # ModelArgs.rope_long); other families do not, so their numbers would differ.
        raise ValueError(f"rope type 'longrope' is supported for {_PHI3} only, not {arch}")
    rotary_dim = _rotary_dim(rope, cfg, arch, head_dim)
    max_original = int(cfg.get("original_max_position_embeddings")
                       or rope.get("original_max_position_embeddings") or max_pos)
    out: dict[str, Any] = dict(
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or default_theta),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor") or 1.0),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        # A top-level value wins over the rope dict's, as in transformers.
        rope_original_max_position_embeddings=max_original,
        rotary_dim=rotary_dim,
    )
    if rope_type == "longrope":
        out.update(_longrope(rope, rotary_dim, max_pos, max_original))
    return out


def _rotary_dim(rope: dict[str, Any], cfg: dict[str, Any], arch: str, head_dim: int) -> int:
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf in (None, 1, 1.0):
        return head_dim
    if arch not in _PARTIAL_ROTARY:
        raise ValueError(f"unsupported partial_rotary_factor {prf}")
    dim = int(head_dim * float(prf))
    if dim <= 0 or dim % 2:
        raise ValueError(f"partial_rotary_factor {prf} gives {dim} rotary dimensions of "
                         f"head_dim {head_dim}; expected a positive even number")
    return dim


def _longrope(rope: dict[str, Any], rotary_dim: int, max_pos: int,
              max_original: int) -> dict[str, Any]:
    """LongRoPE's per-frequency factors and the cos/sin scale (transformers'
    `_compute_longrope_parameters`)."""
    factors: dict[str, tuple[float, ...]] = {}
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if (not isinstance(value, list) or len(value) != rotary_dim // 2
                or not all(isinstance(x, (int, float)) for x in value)):
            raise ValueError(f"rope_scaling.{key} must list {rotary_dim // 2} numbers (one per "
                             f"rotary frequency), got {value!r}")
        factors[key] = tuple(float(x) for x in value)
    factor = rope.get("factor")
    scale = max_pos / max_original if factor is None else float(factor)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(max_original))
    return dict(rope_short_factor=factors["short_factor"], rope_long_factor=factors["long_factor"],
                rope_attention_factor=float(attention))
