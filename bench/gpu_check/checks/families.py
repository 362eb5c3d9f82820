"""The model-family stage of `scripts/gpu-check`: an MoE shape and a Gemma 3 shape, with
random weights made on the device (`--load-format dummy`), through `tandem bench step`.

On the GPU the shapes are the published ones (Qwen3-30B-A3B's expert layers, cut to fewer
layers so the stage fits its budget; Gemma-3-4B's text model), so the grouped expert matmuls
and the sliding-window reads run at their real sizes; the `--cpu` flow runs the same configs
shrunk to tiny widths.  No HF baseline: the parity of every family is the tests' job
(tests/gpu_worker/test_model_families*.py, whose `gpu`-marked cases the gpu tests stage runs).
"""
from __future__ import annotations

import json
import os
from typing import Any

from tandem_serve.bench.gpu_check.models import config_variant, tiny_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget
from tandem_serve.bench.gpu_check.supervise import tandem

QWEN3_MOE: dict[str, Any] = {  # Qwen3-30B-A3B, as its config.json spells it
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False}
GEMMA3: dict[str, Any] = {  # Gemma-3-4B's text model
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True}
GPU_LAYERS = {"qwen3-moe": 12, "gemma3": 34}  # the MoE cut so its dummy load stays short
TINY: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512,
                        "sliding_window": 32, "query_pre_attn_scalar": 16, "rope_scaling": None}
TINY_LAYERS = {"qwen3-moe": 2, "gemma3": 6}
SHAPES = {"qwen3-moe": QWEN3_MOE, "gemma3": GEMMA3}


def family_config(name: str, gpu: bool) -> dict[str, Any]:
    """The config.json of `name`'s shape: published widths on the GPU, tiny ones on the CPU."""
    config = dict(SHAPES[name])
    if not gpu:
        config.update({k: v for k, v in TINY.items() if k in config})
    config["num_hidden_layers"] = (GPU_LAYERS if gpu else TINY_LAYERS)[name]
    config["torch_dtype"] = "bfloat16"
    return config


def family_model(name: str, gpu: bool, out: str) -> str:
    """A folder with the shape's config.json and the tiny model's tokenizer files (the step
    benchmark feeds random token ids; the tokenizer only has to load)."""
    return config_variant(tiny_model(out, "default"),
                          os.path.join(out, "models", f"{name}-shaped"),
                          family_config(name, gpu))


def stage_families(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    gpu = plan.device == "cuda"
    figures: dict[str, Any] = {}
    lines = ["| family | layers | batch | ms/step |", "|---|---:|---:|---:|"]
    for name in SHAPES:
        model = family_model(name, gpu, out)
        path = os.path.join(out, f"step-{name}.json")
        proc = tandem("bench", "step", "--model", model, "--device", plan.device,
                      "--dtype", plan.dtype, "--batch-sizes", plan.step_batches,
                      "--prompt-len", str(plan.step_prompt_len), "--steps",
                      str(plan.step_steps), "--repeats", "1", "--no-hf",
                      "--load-format", "dummy", "--json", path,
                      timeout=max(10.0, budget.left / 2 - 5))
        if proc.returncode:
            raise RuntimeError(f"bench step on the {name} shape failed: {proc.stderr[-800:]}")
        with open(path) as f:
            rows = json.load(f)["rows"]
        figures[name] = rows
        layers = family_config(name, gpu)["num_hidden_layers"]
        lines += [f"| {name} | {layers} | {r['batch']} | {r['ours_ms']:.3f} |" for r in rows]
    return figures, "\n".join(lines) + "\n"
