"""The checkpoints `scripts/gpu-check` runs: the tiny presets from the model cache, and the
seed's Llama-3-8B shape with random weights made on the device (`--load-format dummy`);
what a decode step of them must read; and the experiment's servers' flags, with a KV cache
sized from the device's free memory."""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

from tandem_serve.bench.gpu_check.plans import Plan

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.models.config import ModelArgs

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
LLAMA3_VOCAB = 128256  # Llama 3's tokenizer; the served shape keeps the tiny model's 32k
# Device memory kept free beside the weights and the KV cache: activations, CUDA graphs'
# pools, the sampler's buffers, the CUDA context (GiB, and a share of the device).
KV_MARGIN_GIB = 8.0
KV_MARGIN_SHARE = 0.08


def tiny_model(out: str, preset: str) -> str:
    """The tiny model of `preset`, from the model cache (built there once)."""
    from tandem_serve.harness.tiny_model import ensure_default_model

    return str(ensure_default_model(preset, in_subprocess=True))


def shaped_model(out: str, name: str, changes: dict[str, Any]) -> str:
    """A folder with the tiny default model's tokenizer files and its config.json changed by
    `changes`, for `--load-format dummy` (random weights of that shape, made on the device)."""
    tiny = tiny_model(out, "default")
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    return config_variant(tiny, os.path.join(out, "models", name), config)


def config_variant(source: str, path: str, config: dict[str, Any]) -> str:
    """`path`: `source`'s files but its weights (the tokenizer, the generation config) and
    `config` as its config.json, for `--load-format dummy` or a checkpoint written later."""
    os.makedirs(path, exist_ok=True)
    for entry in os.listdir(source):
        if not entry.endswith(".safetensors") and entry != "config.json":
            shutil.copy(os.path.join(source, entry), path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def experiment_model(plan: Plan, out: str) -> tuple[str, list[str]]:
    """The experiment's model folder and the server flags it needs."""
    if plan.experiment_model != "llama3-8b":
        return tiny_model(out, plan.experiment_model), []
    return (shaped_model(out, "llama3-8b-shaped", {**LLAMA3_8B, "torch_dtype": "bfloat16"}),
            ["--load-format", "dummy"])


def probe_model(plan: Plan, out: str) -> tuple[str, str]:
    """The probe's model folder and load format: the 8B shape with Llama 3's vocabulary (no
    text is tokenized there: its requests are token ids), or a tiny preset's checkpoint."""
    if plan.probe_model != "llama3-8b":
        return tiny_model(out, plan.probe_model), "auto"
    return shaped_model(out, "llama3-8b-probe", {**LLAMA3_8B, "vocab_size": LLAMA3_VOCAB,
                                                 "torch_dtype": "bfloat16"}), "dummy"


def _args(model: str) -> ModelArgs:
    from tandem_serve.gpu_worker.models.config import ModelArgs

    with open(os.path.join(model, "config.json")) as f:
        return ModelArgs.from_hf_config(json.load(f))


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}[dtype]


def decode_weight_bytes(model: str, dtype: str) -> int:
    """Bytes of weights one decode step reads: every layer's and the LM head's (the
    embedding is a gather of B rows)."""
    a = _args(model)
    h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
    per_layer = h * (a.num_heads + 2 * a.num_kv_heads) * d + a.num_heads * d * h + 3 * h * i
    params = a.num_layers * per_layer + a.vocab_size * h
    return params * dtype_bytes(dtype)


def kv_bytes_per_token(model: str, kv_dtype: str) -> int:
    """Bytes of K and V one token holds over every layer (what attending to it reads)."""
    a = _args(model)
    return a.num_layers * 2 * a.num_kv_heads * a.head_dim * dtype_bytes(kv_dtype)


def kv_cache_gib(weight_bytes: int, margin_gib: float = KV_MARGIN_GIB) -> float:
    """GiB of KV cache a server of `weight_bytes` weights can take on this CUDA device now:
    free memory less the weights and a margin (the larger of `margin_gib` and a share of
    the device), rounded down to a GiB. The server's own default fits `--max-num-seqs`
    whole sequences, which caps the 8B shape at 4 GiB (32k tokens) on a 141 GB card."""
    import torch

    torch.cuda.empty_cache()  # what this process cached (parity's HF model) is free too
    free, total = torch.cuda.mem_get_info()
    margin = max(margin_gib * 2**30, KV_MARGIN_SHARE * total)
    return float(max(int((free - weight_bytes - margin) / 2**30), 1))


def serve_flags(plan: Plan, out: str) -> tuple[str, list[str]]:
    """The seed experiment's model and its servers' flags (the arrivals and kv fp8 stages
    serve the same): device, dtype, `--max-num-seqs`, and the KV cache the plan asks for."""
    model, flags = experiment_model(plan, out)
    flags = [*flags, "--device", plan.device, "--dtype", plan.dtype, *plan.server_args,
             "--max-num-seqs", str(plan.experiment_max_num_seqs)]
    if plan.kv_cache_memory == "free" and plan.device == "cuda":
        gib = kv_cache_gib(full_weight_bytes(model, plan.dtype))
        flags += ["--kv-cache-memory", f"{gib:g}"]
    elif plan.kv_cache_memory not in ("", "free"):
        flags += ["--kv-cache-memory", plan.kv_cache_memory]
    return model, flags


def full_weight_bytes(model: str, dtype: str) -> int:
    """Bytes every weight holds (the step's reads and the embedding, when not tied)."""
    a = _args(model)
    embed = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    return decode_weight_bytes(model, dtype) + embed * dtype_bytes(dtype)
