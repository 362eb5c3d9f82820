"""Synthetic PEFT LoRA adapters for benchmarks, written with numpy and safetensors in PEFT's
layout (random weights, alpha = rank): their speed does not depend on the values, and no
torch or peft is needed."""
from __future__ import annotations

import json
import os

import numpy as np

from tandem_serve.adapters.peft import MODULES, ModelShapes


def write_adapter(folder: str, shapes: ModelShapes, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of `rank` on every linear layer, random weights."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module, parent in MODULES.items():
            out_features, in_features = shapes.linears[module]
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, in_features)) /
                                               np.sqrt(in_features)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) *
                                               0.02).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
              "target_modules": list(MODULES), "bias": "none"}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def model_shapes(model: str) -> ModelShapes:
    from tandem_serve.gpu_worker.models.config import ModelArgs

    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        return ModelShapes.of(ModelArgs.from_hf_config(json.load(f)))


def write_adapters(cache: str, model: str, ids: list[str], rank: int) -> None:
    """One adapter per id in `cache` (adapter i seeded with i), shaped for `model`."""
    shapes = model_shapes(model)
    for i, adapter_id in enumerate(ids):
        write_adapter(os.path.join(cache, adapter_id), shapes, rank, seed=i)
