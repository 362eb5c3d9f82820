"""Quantize a float tiny checkpoint into each published layout, by the layouts' own
documentation (written independently of the engine's readers, so the two check each other).

    quant_path, ref_path = quantize(src, root, "gptq")

`ref_path` holds the dequantized float32 weights (what HF `generate()` runs as the
reference). Scales are powers of two, so dequantization is exact in float32 and a model
that reads the layout right holds exactly the reference's weights.

Layouts (a linear with weight [out, in], group g):
* fp8 (HF fine-grained): `weight` e4m3 [out, in], `weight_scale_inv` [⌈out/bo⌉, ⌈in/bi⌉];
  W = q · s per block.
* compressed-tensors float-quantized: `weight` e4m3, `weight_scale` [out, 1].
* compressed-tensors pack-quantized: `weight_packed` int32 [out, in/8], input column i at
  bits 4 (i % 8) of word i / 8, stored as q + 8; `weight_scale` [out, in/g]; `weight_shape`.
* GPTQ v1: `qweight` int32 [in/8, out] (input row 8r + j at bits 4j), `qzeros` int32
  [in/g, out/8] storing zero − 1, `scales` fp16 [in/g, out], `g_idx` [in];
  W = (q − (z + 1)) · s.
* AWQ GEMM: `qweight` [in, out/8] and `qzeros` [in/g, out/8] with nibble i holding column
  8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; `scales` fp16 [in/g, out]; W = (q − z) · s (asymmetric
  zeros here, so zero points other than 8 are exercised).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8-block", "ct-fp8", "ct-w4a16", "gptq", "awq")
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                     r"\.weight$")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FP8 = torch.float8_e4m3fn


def _pow2(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= qmax (so q = W / s fits)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax)))


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    out, inp = w.shape
    return w.view(out, inp // g, g)


def _pack(u: torch.Tensor, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Values 0..15 -> int32 words of 8 along `dim` (value j at bits 4j; AWQ: value
    order[j] of each 8 at bits 4j)."""
    u = u.to(torch.int64).movedim(dim, -1)
    u = u.reshape(*u.shape[:-1], -1, 8)
    if order is not None:
        u = u[..., order]
    words = sum(u[..., j] << (4 * j) for j in range(8))
    assert isinstance(words, torch.Tensor)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def fp8_block(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    bo, bi = block
    out, inp = w.shape
    nbo, nbi = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(nbo * bo, nbi * bi)
    padded[:out, :inp] = w.abs()
    s = _pow2(padded.view(nbo, bo, nbi, bi).amax(dim=(1, 3)), 448.0)
    full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp]
    q = (w / full).to(FP8)
    return {"weight": q, "weight_scale_inv": s.to(scale_dtype)}, q.float() * full


def ct_fp8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    s = _pow2(w.abs().amax(dim=1, keepdim=True), 448.0)
    q = (w / s).to(FP8)
    return {"weight": q, "weight_scale": s.to(torch.bfloat16)}, q.float() * s


def _sym_int4(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in -8..7 [out, in], scales [out, in/g]) with q · s = the dequantized weight."""
    grouped = _groups(w, g)
    s = _pow2(grouped.abs().amax(dim=2), 7.0)
    q = torch.round(grouped / s.unsqueeze(2)).clamp(-8, 7)
    return q.reshape(w.shape), s


def ct_w4a16(w: torch.Tensor, g: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, s = _sym_int4(w, g)
    deq = (_groups(q, g) * s.unsqueeze(2)).reshape(w.shape)
    tensors = {"weight_packed": _pack(q + 8, 1), "weight_scale": s.to(torch.bfloat16),
               "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    return tensors, deq


def gptq(w: torch.Tensor, g: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, s = _sym_int4(w, g)
    deq = (_groups(q, g) * s.unsqueeze(2)).reshape(w.shape)
    out, inp = w.shape
    zeros = torch.full((inp // g, out), 8 - 1)  # symmetric: zero 8, stored minus one
    tensors = {"qweight": _pack((q + 8).t(), 0), "qzeros": _pack(zeros, 1),
               "scales": s.t().to(torch.float16).contiguous(),
               "g_idx": (torch.arange(inp) // g).to(torch.int32)}
    return tensors, deq


def awq(w: torch.Tensor, g: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    grouped = _groups(w, g)
    lo, hi = grouped.amin(dim=2).clamp(max=0), grouped.amax(dim=2).clamp(min=0)
    s = _pow2(hi - lo, 15.0)
    z = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(grouped / s.unsqueeze(2)) + z.unsqueeze(2)).clamp(0, 15)
    deq = ((q - z.unsqueeze(2)) * s.unsqueeze(2)).reshape(w.shape)
    tensors = {"qweight": _pack(q.reshape(w.shape).t(), 1, _AWQ_ORDER),
               "qzeros": _pack(z.t(), 1, _AWQ_ORDER),
               "scales": s.t().to(torch.float16).contiguous()}
    return tensors, deq


def quant_config(fmt: str, group: int, block: tuple[int, int], published: bool
                 ) -> dict[str, Any]:
    """config.json's quantization_config: as published checkpoints spell it, or as
    transformers 5 writes it (compressed-tensors: as llm-compressor writes it). `group`
    0: one scale per output channel."""
    if fmt in ("gptq", "awq") and group <= 0:
        group = -1
    if fmt == "fp8-block":
        if published:  # Qwen3-FP8 / DeepSeek-V3
            return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": list(block)}
        from transformers import FineGrainedFP8Config
        return _json(FineGrainedFP8Config(weight_block_size=list(block)))
    if fmt == "gptq":
        if published:  # AutoGPTQ-era keys (quantize_config.json's)
            return {"bits": 4, "group_size": group, "damp_percent": 0.1, "desc_act": False,
                    "sym": True, "true_sequential": True, "model_name_or_path": None,
                    "model_file_base_name": "model", "static_groups": False,
                    "checkpoint_format": "gptq", "quant_method": "gptq"}
        from transformers import GPTQConfig
        return _json(GPTQConfig(bits=4, group_size=group, desc_act=False, sym=True))
    if fmt == "awq":
        if published:
            return {"quant_method": "awq", "zero_point": True, "group_size": group, "bits": 4,
                    "version": "gemm", "modules_to_not_convert": None}
        from transformers import AwqConfig
        return _json(AwqConfig(bits=4, group_size=group, zero_point=True, version="gemm"))
    return _ct_config(fmt, group)


def _json(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(config.to_json_string())
    return out


def _ct_config(fmt: str, group: int) -> dict[str, Any]:
    common = {"actorder": None, "block_structure": None, "observer": "minmax",
              "observer_kwargs": {}, "symmetric": True, "dynamic": False}
    if fmt == "ct-fp8":
        weights = {**common, "num_bits": 8, "type": "float", "strategy": "channel",
                   "group_size": None}
        acts: dict[str, Any] | None = {
            **common, "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
            "observer": None}
        form = "float-quantized"
    else:
        weights = {**common, "num_bits": 4, "type": "int",
                   "strategy": "group" if group > 0 else "channel",
                   "group_size": group if group > 0 else None}
        acts, form = None, "pack-quantized"
    return {"config_groups": {"group_0": {"input_activations": acts, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": form, "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}}


def quantize(src: str, root: str | os.PathLike[str], fmt: str, *, group: int = 32,
             block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = torch.bfloat16,
             published: bool = False, config: dict[str, Any] | None = None
             ) -> tuple[str, str]:
    """(the quantized folder, the reference folder with its dequantized float32 weights).
    `config` replaces the quantization_config written (to test refusals)."""
    state = load_file(os.path.join(src, "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not _LINEAR.match(name):
            quant[name] = ref[name] = w
            continue
        tensors, deq = _quantize_one(w.float(), fmt, group, block, scale_dtype)
        module = name.removesuffix(".weight")
        quant.update({f"{module}.{k}": v for k, v in tensors.items()})
        ref[name] = deq
    paths = []
    for kind, tensors in (("quant", quant), ("ref", ref)):
        path = tempfile.mkdtemp(prefix=f"{fmt}-{kind}-", dir=os.fspath(root))
        for f in os.listdir(src):
            if f != "model.safetensors" and not f.endswith(".index.json"):
                shutil.copy(os.path.join(src, f), path)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        paths.append(path)
    cfg_path = os.path.join(paths[0], "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = config or quant_config(fmt, group, block, published)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return paths[0], paths[1]


def _quantize_one(w: torch.Tensor, fmt: str, group: int, block: tuple[int, int],
                  scale_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if fmt == "fp8-block":
        return fp8_block(w, block, scale_dtype)
    if fmt == "ct-fp8":
        return ct_fp8(w)
    g = group if group > 0 else w.shape[1]
    return {"ct-w4a16": ct_w4a16, "gptq": gptq, "awq": awq}[fmt](w, g)


def assert_pow2(t: torch.Tensor) -> None:
    m, _ = torch.frexp(t.float())
    assert bool((m.abs() == 0.5).all()), "scales must be powers of two"
    assert math.isfinite(float(t.float().abs().max()))
