"""Tiny PEFT LoRA adapters for tests, and PEFT's own greedy output as the judge.

    cache = tmp_path / "adapters"
    make_adapter(model_dir, cache / "attn", **ADAPTERS["attn"])
    peft_greedy(model_dir, cache / "attn", prompts, 16)  # HF generate() through PeftModel

Adapters are made by `peft` itself (`get_peft_model` + `save_pretrained`) with their lora_B
weights randomised: PEFT starts B at zero, which would make every adapter a no-op.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

# The three adapters of the parity tests: attention only, every linear layer (one module at
# a lower rank), MLP only with its own alpha.
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                 seed=11),
    "all": dict(r=8, lora_alpha=16, target_modules="all-linear",
                rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 4}, seed=12),
    "mlp": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                seed=13),
}


def _base(model_dir: str | os.PathLike[str]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.no_grad()
def make_adapter(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                 seed: int = 0, b_std: float = 0.25, **lora: Any) -> Path:
    """Write a PEFT LoRA adapter for the checkpoint at `model_dir` into `out_dir`."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_base(model_dir), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * b_std)
        elif "lora_A" in name:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def make_adapters(model_dir: str | os.PathLike[str], root: str | os.PathLike[str],
                  names: Iterable[str] = tuple(ADAPTERS)) -> Path:
    """Write the named adapters of `ADAPTERS` into `root/<name>`; return `root`."""
    for name in names:
        make_adapter(model_dir, Path(root) / name, **ADAPTERS[name])
    return Path(root)


@torch.no_grad()
def peft_greedy(model_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str] | None,
                prompts: list[list[int]], max_new_tokens: int,
                min_new_tokens: int = 0) -> list[list[int]]:
    """HF `generate(do_sample=False)` through `PeftModel.from_pretrained`, float32, one
    prompt at a time; the base model alone when `adapter_dir` is None."""
    model = _base(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.int64)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=min_new_tokens)
        out.append(gen[0, len(prompt):].tolist())
    return out
