"""The rotary embeddings of one model: which inverse frequencies each layer uses, and the
cos/sin of a forward's positions.

Most models have one RoPE. Gemma 3 has two: its sliding layers use their own base
(`rope_local_base_freq`), its global layers `rope_theta` with its scaling. LongRoPE (Phi-3)
has two sets of frequencies and a cos/sin scale; which set a token is rotated with follows
transformers' Phi-3, where a sequence is computed with the long factors as soon as it is
longer than `original_max_position_embeddings` (its `generate` then recomputes the whole
sequence with them), so:

* a prefill token uses the long factors iff its request's history (what the prefill
  computes, plus the last token, which the first decode step feeds) is longer than that;
* a decode token at position p uses them iff p >= that length.

The two agree wherever transformers' rule is a function of the token and its request's
history alone, so a request gives the same tokens alone, in a batch, chunked or resumed
after preemption. Where they cannot agree is a request that grows past the length while it
decodes: transformers recomputes the keys already in the cache with the long factors;
here they stay as they were computed (a resume recomputes them, as transformers does).
"""
from __future__ import annotations

import dataclasses

import torch

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.layers import rope_inv_freq

CosSin = tuple[torch.Tensor, torch.Tensor]


class Rope:
    """One set of rotary frequencies; `cos_sin` gives [T, 1, rotary_dim] in the model dtype."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0,
                 long_inv_freq: torch.Tensor | None = None, max_original: int = 0,
                 mrope_axis: torch.Tensor | None = None) -> None:
        self.inv_freq = inv_freq
        self.attention_factor = attention_factor
        self.long_inv_freq = long_inv_freq
        self.max_original = max_original
        # M-RoPE (Qwen VL): per frequency, the position axis (temporal, height, width) that
        # rotates it; positions then come as [3, T] (or [T]: all three axes equal).
        self.mrope_axis = mrope_axis

    def to(self, device: torch.device) -> Rope:
        long = None if self.long_inv_freq is None else self.long_inv_freq.to(device)
        axis = None if self.mrope_axis is None else self.mrope_axis.to(device)
        return Rope(self.inv_freq.to(device), self.attention_factor, long, self.max_original,
                    axis)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                history_lens: torch.Tensor | None = None) -> CosSin:
        if positions.dim() == 2:  # M-RoPE: each frequency takes its own axis' position
            assert self.mrope_axis is not None, "[3, T] positions need an M-RoPE model"
            pos = positions.float().T.gather(
                1, self.mrope_axis[None, :].expand(positions.shape[1], -1))
            return self._cos_sin(pos * self.inv_freq[None, :], dtype)
        pos = positions.float()[:, None]
        if self.long_inv_freq is None:
            freqs = pos * self.inv_freq[None, :]
        else:
            long = positions >= self.max_original
            if history_lens is not None:
                long = long | (history_lens > self.max_original)
            inv = torch.where(long[:, None], self.long_inv_freq[None, :], self.inv_freq[None, :])
            freqs = pos * inv
        return self._cos_sin(freqs, dtype)

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> CosSin:
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def model_ropes(args: ModelArgs) -> tuple[list[Rope], list[int]]:
    """The model's ropes and, per layer, the index of the one it uses."""
    ropes = [_global_rope(args)]
    which = [0] * args.num_layers
    if args.local_rope_theta is not None:
        local = dataclasses.replace(args, rope_theta=args.local_rope_theta, rope_type="default")
        ropes.append(Rope(rope_inv_freq(local)))
        windows = args.sliding_windows or (None,) * args.num_layers
        which = [1 if w is not None else 0 for w in windows]
    return ropes, which


def _mrope_axis(args: ModelArgs) -> torch.Tensor:
    """Per rotary frequency, the position axis (0 t, 1 h, 2 w) that rotates it, as
    transformers' `recomposition_frequencies` picks them: the sections in order (Qwen2.5-VL),
    or interleaved t h w t h w ... with h and w on every third frequency up to three times
    their sections, t on the rest (Qwen3-VL, Qwen3.5)."""
    section = args.mrope_section
    if not args.mrope_interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.int64)
                          for i, n in enumerate(section)])
    axis = torch.zeros((args.rotary_dim or args.head_dim) // 2, dtype=torch.int64)
    for dim in (1, 2):
        axis[dim:section[dim] * 3:3] = dim
    return axis


def _global_rope(args: ModelArgs) -> Rope:
    if args.mrope_section:
        return Rope(rope_inv_freq(args), mrope_axis=_mrope_axis(args))
    if args.rope_type != "longrope":
        return Rope(rope_inv_freq(args))
    dim = args.rotary_dim or args.head_dim
    # As transformers' `_compute_longrope_parameters` computes them, operation for operation.
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = args.rope_theta ** shape

    def inv(factors: tuple[float, ...]) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)

    return Rope(inv(args.rope_short_factor), args.rope_attention_factor,
                inv(args.rope_long_factor), args.rope_original_max_position_embeddings or 0)
