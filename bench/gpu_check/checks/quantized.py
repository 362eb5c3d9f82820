"""The quantized stage of `scripts/gpu-check`: the step stage's model (the seed's
Llama-3-8B shape on the GPU, random weights made on the device by `--load-format dummy`)
with a `quantization_config` per format, through `tandem bench step`, next to the plain
model in the plan's dtype: ms/step and the bytes the weights hold.

What each arm exercises on an sm89+ GPU in bfloat16 (`gpu_worker/models/quant/linear.py`):
compressed-tensors FP8 runs `torch._scaled_mm` with per-token activation scales, HF's
block-scaled FP8 dequantizes per forward (the weights stay e4m3 in memory), GPTQ runs
torch's int4 kernel. On the CPU the weights are dequantized at load, so the `--cpu` flow
checks the plumbing, not the speed. Parity is the tests' job
(tests/gpu_worker/test_quant_*.py); here the figures, and that every format loads.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from tandem_serve.bench.gpu_check.models import config_variant, experiment_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget
from tandem_serve.bench.gpu_check.supervise import tandem

# The configs as the published checkpoints spell them (Qwen3-FP8; llm-compressor's
# FP8-dynamic; AutoGPTQ's), for a model whose widths are multiples of 128.
_CT_GROUP = {"targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                         "strategy": "channel", "dynamic": False, "group_size": None},
             "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                   "strategy": "token", "dynamic": True}}
CONFIGS: dict[str, dict[str, Any]] = {
    "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": _CT_GROUP}, "ignore": ["lm_head"],
               "kv_cache_scheme": None, "quantization_status": "compressed"},
    "fp8-block": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": [128, 128]},
    "gptq": {"bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "true_sequential": True, "damp_percent": 0.1, "quant_method": "gptq"},
}


GROUP = 128  # GPTQ's usual group; the fitted widths are multiples of it


def fitted_model(model: str, out: str, formats: tuple[str, ...]) -> str:
    """`model`, or where a format of `formats` takes int4 groups and the model's widths take
    none (the tiny default preset's MLP is 688 wide: no multiple of 32), a copy of its folder
    with the hidden and MLP widths rounded up to multiples of 128.  Every arm then serves
    that one shape with dummy weights, the plain one too, so they still compare."""
    if not any("group_size" in CONFIGS[f] for f in formats):
        return model
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    widths = {k: int(config[k]) for k in ("hidden_size", "intermediate_size")}
    fitted = {k: -(-v // GROUP) * GROUP for k, v in widths.items()}
    if fitted == widths:
        return model
    if "head_dim" not in config:  # keep the heads' width where it was derived from hidden
        config["head_dim"] = widths["hidden_size"] // int(config["num_attention_heads"])
    config.update(fitted)
    return config_variant(
        model, os.path.join(out, "models", f"{os.path.basename(model.rstrip('/'))}-w{GROUP}"),
        config)


def quantized_folder(model: str, out: str, fmt: str) -> str:
    """A copy of `model`'s folder (config and tokenizer, no weights) asking for `fmt`."""
    path = os.path.join(out, "models", f"{os.path.basename(model.rstrip('/'))}-{fmt}")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(model):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(model, name), path)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    quant = dict(CONFIGS[fmt])
    if "group_size" in quant:  # the tiny presets' widths take smaller groups
        widths = (config["hidden_size"], config["intermediate_size"])
        group = next((g for g in (128, 64, 32) if all(w % g == 0 for w in widths)), None)
        if group is None:
            raise ValueError(f"{fmt}: widths {widths} take no int4 group size (32, 64, 128)")
        quant["group_size"] = group
    config["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def stage_quantized(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    model = fitted_model(experiment_model(plan, out)[0], out, plan.quant_formats)
    arms = {plan.dtype: model, **{f: quantized_folder(model, out, f)
                                   for f in plan.quant_formats}}
    rows: dict[str, list[dict[str, Any]]] = {}
    for arm, folder in arms.items():
        path = os.path.join(out, f"step-{arm}.json")
        proc = tandem("bench", "step", "--model", folder, "--device", plan.device,
                      "--dtype", plan.dtype, "--load-format", "dummy", "--no-hf",
                      "--batch-sizes", plan.step_batches, "--prompt-len",
                      str(plan.step_prompt_len), "--steps", str(plan.step_steps),
                      "--repeats", "1", "--json", path, timeout=max(30.0, budget.left - 10))
        if proc.returncode:
            raise RuntimeError(f"bench step ({arm}) failed: {proc.stderr[-800:]}")
        with open(path) as f:
            rows[arm] = json.load(f)["rows"]
    note = "" if model == experiment_model(plan, out)[0] else (
        f"The model's widths rounded up to multiples of {GROUP} for int4 groups "
        f"({os.path.basename(model)}), every arm alike.\n\n")
    return {"rows": rows, "model": os.path.basename(model)}, note + quant_table(rows,
                                                                                 plan.dtype)


def quant_table(rows: dict[str, list[dict[str, Any]]], base: str) -> str:
    lines = ["| weights | GiB | batch | ms/step | vs " + base + " |", "|---|---:|---:|---:|---:|"]
    plain = {r["batch"]: r["ours_ms"] for r in rows[base]}
    for arm, arm_rows in rows.items():
        for r in arm_rows:
            ratio = r["ours_ms"] / plain[r["batch"]] if plain.get(r["batch"]) else 0.0
            lines.append(f"| {arm} | {r['weight_bytes'] / 2**30:.2f} | {r['batch']} | "
                         f"{r['ours_ms']:.2f} | {ratio:.2f} |")
    return "\n".join(lines)
