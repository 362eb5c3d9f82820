"""The checkpoints `scripts/gpu-check` runs: the tiny presets from the model cache, and the
seed's Llama-3-8B shape with random weights made on the device (`--load-format dummy`)."""
from __future__ import annotations

import json
import os
import shutil

from tandem_serve.bench.gpu_check.plans import Plan

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def tiny_model(out: str, preset: str) -> str:
    """The tiny model of `preset`, from the model cache (built there once)."""
    from tandem_serve.harness.tiny_model import ensure_default_model

    return str(ensure_default_model(preset, in_subprocess=True))


def experiment_model(plan: Plan, out: str) -> tuple[str, list[str]]:
    """The experiment's model folder and the server flags it needs."""
    if plan.experiment_model != "llama3-8b":
        return tiny_model(out, plan.experiment_model), []
    tiny = tiny_model(out, "default")
    path = os.path.join(out, "models", "llama3-8b-shaped")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tiny):  # the tokenizer and generation config, not the weights
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(tiny, name), path)
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    config.update(LLAMA3_8B, torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path, ["--load-format", "dummy"]


def decode_weight_bytes(model: str, dtype: str) -> int:
    from tandem_serve.gpu_worker.models.config import ModelArgs

    with open(os.path.join(model, "config.json")) as f:
        a = ModelArgs.from_hf_config(json.load(f))
    h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
    per_layer = h * (a.num_heads + 2 * a.num_kv_heads) * d + a.num_heads * d * h + 3 * h * i
    # A decode step reads every layer and the LM head; the embedding is a gather of B rows.
    params = a.num_layers * per_layer + a.vocab_size * h
    return params * (4 if dtype == "float32" else 2)
