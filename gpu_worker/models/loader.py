"""Model loading: HF checkpoint directory -> CausalLM on the target dtype/device."""

from __future__ import annotations

import logging
import os

import torch

from gpu_worker.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from gpu_worker.models.llama import CausalLM
from gpu_worker.models.sharding import Shard, checkpoint_part, local_args
from gpu_worker.weights import SafetensorsCheckpoint, read_json

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelArgs", "load_model", "load_model_args"]

log = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# Checkpoint entries that carry no weights of ours (recomputed buffers).
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


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


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device,
               onednn: bool = True, flash_attn: bool = True,
               shard: Shard | None = None) -> CausalLM:
    """Load a Llama/Mistral/Qwen2/Qwen3 checkpoint into our CausalLM.

    `onednn`: on CPU in float32, run the linear layers through oneDNN with pre-packed weights
    (see `pack_linear`); False keeps plain F.linear.  `flash_attn`: attend with flash_attn
    where it can serve the cache (CUDA, 16-bit); False always uses SDPA.

    Every expected tensor's presence and shape is checked before any data is read, so a
    broken checkpoint fails fast with a ValueError naming the tensor.

    `shard`: tensor parallelism; the model holds (and reads from the files) only this rank's
    part of each tensor (`gpu_worker.models.sharding`), and its `config` is the rank's shape.
    The collectives that join the shards are installed by `gpu_worker.parallel`.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    device = torch.device(device)
    args = load_model_args(model_dir)
    shard = shard or Shard()
    # The checkpoint has the whole model's shapes; this rank's modules have its own.
    expected = CausalLM(args).expected_weights()
    model = CausalLM(local_args(args, shard))
    with SafetensorsCheckpoint(model_dir, device) as ckpt:
        present = ckpt.names()
        missing = [n for n in expected if n not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"missing weight {missing[0]!r}{more} in {model_dir}")
        for name, shape in expected.items():
            found = ckpt.shape(name)
            if found != shape:
                raise ValueError(
                    f"unexpected shape for weight {name!r}: {found}, expected {shape} "
                    f"({args.architecture} config in {model_dir})"
                )
        extra = sorted(
            n
            for n in present - expected.keys()
            if not n.endswith(_HARMLESS_SUFFIXES) and n != "lm_head.weight"
        )
        if extra:
            log.warning("ignoring %d unexpected checkpoint tensors: %s", len(extra), extra[:8])
        def get(name: str) -> torch.Tensor:
            part = checkpoint_part(name, args, shard)
            if part.zeros:
                return torch.zeros(expected[name], dtype=dtype, device=device)
            return ckpt.get_part(name, dtype, part.dim, part.start, part.stop)

        model.load_weights(get)
    if onednn:
        model.pack_weights()
    model.allow_flash = flash_attn
    model.eval()
    return model
