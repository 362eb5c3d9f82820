"""Model loading: HF checkpoint directory -> CausalLM on the target dtype/device."""

from __future__ import annotations

import logging
import os
import zlib
from typing import cast

import torch

from tandem_serve.gpu_worker.models import layout
from tandem_serve.gpu_worker.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from tandem_serve.gpu_worker.models.decoder import CausalLM, DecoderLayer
from tandem_serve.gpu_worker.models.fill import load_weights
from tandem_serve.gpu_worker.models.hybrid.model import HybridLM
from tandem_serve.gpu_worker.models.quant import load as quant_load
from tandem_serve.gpu_worker.models.quant.dummy import DummyQuantLinears
from tandem_serve.gpu_worker.models.quant.split import problems as quant_problems
from tandem_serve.gpu_worker.models.sharding import Part, Shard, checkpoint_part, local_args
from tandem_serve.gpu_worker.models.weights import SafetensorsCheckpoint, read_json
from tandem_serve.proto.vision import TOWER_PREFIXES

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelArgs", "load_model", "load_model_args"]

log = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# Checkpoint entries that carry no weights of ours (recomputed buffers).
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
# A VL checkpoint's vision tower and projector, which `gpu_worker.vision.tower` loads.
_VISION_PREFIXES = tuple(TOWER_PREFIXES)


def load_model_args(model_dir: str) -> ModelArgs:
    """Parse config.json (+ generation_config.json) without touching the weights.

    Lets the worker size its KV cache before loading. ValueError on anything unsupported.
    """
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"no config.json in {model_dir}")
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = read_json(gen_path) if os.path.exists(gen_path) else None
    return ModelArgs.from_hf_config(read_json(cfg_path), gen)


LOAD_FORMATS = ("auto", "dummy")
# Whether a quantized checkpoint stays quantized on the CPU by default (on CUDA it always
# does): off, its linears are dequantized exactly at load and run through oneDNN like any
# float weight; tests turn it on to run the quantized kernels' CPU paths in a whole model.
CPU_KEEPS_QUANTIZED = False


def dummy_weight(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """A random weight made on the device, seeded by its name (`--load-format dummy`).

    For benchmarks of real model shapes without their checkpoints (vLLM's `dummy` format):
    norms are ones and matrices N(0, 0.02), so activations stay in range and the decode
    costs what the real model's does; the tokens it picks are meaningless. Every rank of a
    tensor-parallel group makes the same whole tensor and keeps its part.
    """
    if "norm" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(0.02)


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device,
               onednn: bool = True, shard: Shard | None = None, load_format: str = "auto",
               keep_quantized: bool | None = None) -> CausalLM:
    """Load a checkpoint of a supported architecture into our CausalLM.

    `onednn`: on CPU in float32, run the linear layers through oneDNN with pre-packed weights
    (see `pack_linear`); False keeps plain F.linear.  The model attends with the SDPA
    backend until its `attention` is set (the runner's start-up choice,
    `gpu_worker.attention.registry`).

    Every expected tensor's presence and shape is checked before any data is read, so a
    broken checkpoint fails fast with a ValueError naming the tensor.

    `shard`: tensor parallelism; the model holds (and reads from the files) only this rank's
    part of each tensor (`gpu_worker.models.sharding`), and its `config` is the rank's shape.
    The collectives that join the shards are installed by `gpu_worker.parallel`.

    `load_format`: "dummy" reads no file but config.json (`dummy_weight`).

    `keep_quantized`: a quantized checkpoint's linears stay quantized on the device and run
    through `models.quant.linear` (default: on CUDA); off, they are dequantized exactly to
    `dtype` at load (the CPU's default: oneDNN then runs them like any float weight).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load format {load_format!r}; supported: {LOAD_FORMATS}")
    device = torch.device(device)
    args = load_model_args(model_dir)
    shard = shard or Shard()
    # The checkpoint has the whole model's shapes; this rank's modules have its own.
    expected = layout.expected_weights(args)
    problems = quant_problems(args, shard.size)
    if problems:
        raise ValueError("; ".join(problems))
    keep = (device.type == "cuda" or CPU_KEEPS_QUANTIZED) if keep_quantized is None \
        else keep_quantized
    model = (HybridLM if args.is_hybrid else CausalLM)(local_args(args, shard))
    if load_format == "dummy":
        def dummy(name: str) -> torch.Tensor:
            return _dummy_part(name, expected[name], args, shard, dtype, device)

        load_weights(model, dummy, None if args.quant is None else DummyQuantLinears(
            args, shard, dtype, _no_file, dummy, keep))
    else:
        _load_checkpoint(model, model_dir, expected, shard, dtype, device, keep)
    log.info("weights: %.3f GiB on %s (%s)", weight_bytes(model) / 2**30, device,
             _format_summary(model))
    if onednn:
        model.pack_weights()
    model.eval()
    return model


def _no_file(name: str, part: Part) -> torch.Tensor:
    raise AssertionError(f"--load-format dummy reads no tensor ({name})")


def _dummy_part(name: str, shape: tuple[int, ...], args: ModelArgs, shard: Shard,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    part = checkpoint_part(name, args, shard)
    if part.zeros:
        return torch.zeros(shape, dtype=dtype, device=device)
    whole = dummy_weight(name, shape, dtype, device)
    if part.dim is None:
        return whole
    return whole.narrow(part.dim, part.start, part.stop - part.start).contiguous()


def weight_bytes(model: CausalLM) -> int:
    """Bytes the model's weights hold on its device: parameters (a tied head once) and the
    quantized linears as stored; oneDNN's packed copies are not counted."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(q.nbytes for layer in model.layers
                       for q in cast(DecoderLayer, layer).quant.values())


def _format_summary(model: CausalLM) -> str:
    q = model.config.quant
    modes = sorted({x.mode for layer in model.layers
                    for x in cast(DecoderLayer, layer).quant.values()})
    if q is None:
        return f"{model.dtype}".removeprefix("torch.")
    kept = f"kept quantized: {', '.join(modes)}" if modes else "dequantized at load"
    return f"{q.kind}, {kept}"


def _load_checkpoint(model: CausalLM, model_dir: str, expected: dict[str, tuple[int, ...]],
                     shard: Shard, dtype: torch.dtype, device: torch.device,
                     keep_quantized: bool) -> None:
    args = load_model_args(model_dir)
    stored = quant_load.checkpoint_shapes(args, layout.checkpoint_shapes(args))
    views = layout.views(args)
    with SafetensorsCheckpoint(model_dir, device) as ckpt:
        if args.language_model:
            left = ckpt.language_model_only()
            if left:
                log.info("the language model of %s: leaving %d tensors of its vision tower "
                         "(loaded on its own) and MTP head (%s)", model_dir, len(left),
                         ", ".join(sorted({n.split(".")[0] + "." + n.split(".")[1]
                                           if n.count(".") > 1 else n for n in left})[:4]))
        present = ckpt.names()
        missing = [n for n in stored if n not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"missing weight {missing[0]!r}{more} in {model_dir}")
        for name, shape in stored.items():
            found = ckpt.shape(name)
            if found != shape:
                raise ValueError(
                    f"unexpected shape for weight {name!r}: {found}, expected {shape} "
                    f"({args.architecture} config in {model_dir})"
                )
        # A VL checkpoint's vision tower is the vision module's (`gpu_worker.vision.tower`).
        lm = {n for n in present if not n.startswith(_VISION_PREFIXES)} \
            if args.image_token_id >= 0 else present
        state, extra = quant_load.unexpected(lm, stored, _HARMLESS_SUFFIXES)
        if state:
            raise quant_load.quant_state_error(state, args)
        if extra:
            log.warning("ignoring %d unexpected checkpoint tensors: %s", len(extra), extra[:8])
        _check_float_dtypes(ckpt, [n for n in stored if not quant_load.is_quant_state(n)],
                            args)

        def get(name: str) -> torch.Tensor:
            part = checkpoint_part(name, args, shard)
            if part.zeros:
                return torch.zeros(expected[name], dtype=dtype, device=device)
            if name in views:  # a part of a fused tensor: its rows there
                fused, first = views[name]
                part = _rows_of_fused(part, first, expected[name][0])
                return ckpt.get_part(fused, dtype, part.dim, part.start, part.stop)
            return ckpt.get_part(name, dtype, part.dim, part.start, part.stop)

        def read(name: str, part: Part) -> torch.Tensor:  # a quantized tensor, as stored
            return ckpt.get_part(name, None, part.dim, part.start, part.stop)

        linears = None if args.quant is None else quant_load.QuantLinears(
            args, shard, dtype, read, get, keep_quantized)
        load_weights(model, get, linears)


def _check_float_dtypes(ckpt: SafetensorsCheckpoint, names: list[str], args: ModelArgs
                        ) -> None:
    """A tensor the model reads as floats must be stored as floats: an e4m3 or integer
    weight without the quantization_config that says how to read it is refused, not cast."""
    quantized = {m + ".weight" for m in quant_load.quantized_modules(args)}  # read by format
    for name in names:
        stored = ckpt.dtype(name)
        if stored not in quant_load.FLOAT_DTYPES and name not in quantized:
            why = ("config.json has no quantization_config" if args.quant is None
                   else f"quantization_config ({args.quant.kind}) does not quantize it")
            raise ValueError(f"weight {name!r} is stored as {stored}, not as floats: {why}")


def _rows_of_fused(part: Part, first: int, rows: int) -> Part:
    """A part of a fused tensor's slice [first, first + rows) as a part of the fused tensor
    (the slices are column-parallel: a rank's part is rows, never columns)."""
    if part.dim is None:
        return Part(0, first, first + rows)
    assert part.dim == 0, "fused tensors are split by rows"
    return Part(0, first + part.start, first + part.stop)
