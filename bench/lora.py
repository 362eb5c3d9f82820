"""`tandem bench lora`: what serving LoRA adapters costs next to the base model alone.

One server (K=8 async by default) with an adapter cache of `--adapters` synthetic adapters
(rank `--rank`, every linear layer), and the same seeded workload run in three arms,
alternately, `--repeats` times each: the base model alone, every request on one adapter,
and requests spread over every adapter (request i on adapter i mod n, as `bench serve
--adapters` does).  It prints median TPOT, ITL and output throughput per arm, and ratios to
the base arm taken within each repeat (then the median), and writes the figures as JSON.

The adapters are written here with numpy and safetensors in PEFT's layout (random weights,
alpha = rank): their speed does not depend on the values, and no torch or peft is needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

from tandem_serve.adapters.peft import MODULES, ModelShapes
from tandem_serve.bench.ab import add_one_server_arguments, run_one_server_arms
from tandem_serve.bench.ab_tables import median_result, paired_table

COLUMNS = [("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("mean_itl_ms", "ITL ms"),
           ("output_throughput", "out tok/s")]


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL", ""),
                   help="model folder (default: the embedded tiny model)")
    p.add_argument("--adapters", type=int, default=4, help="adapters the requests spread over")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    add_one_server_arguments(p, input_len=128)
    p.add_argument("--output-json", default="bench_lora.json")
    p.add_argument("--step", action="store_true",
                   help="instead of serving: decode ms/step in one process, arms alternating "
                        "(bench/lora_step.py), batch --max-concurrency")


def step_main(args: argparse.Namespace, model: str) -> int:
    from tandem_serve.bench.lora_step import step_table

    ids = [f"bench-{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as cache:
        shapes = model_shapes(model)
        for i, adapter_id in enumerate(ids):
            write_adapter(os.path.join(cache, adapter_id), shapes, args.rank, seed=i)
        print(step_table(model, cache, ids, args.rank, batch=args.max_concurrency,
                         prompt_len=args.input_len, k=args.steps, repeats=args.repeats))
    return 0


def main(args: argparse.Namespace) -> int:
    model = args.model
    if not model:
        from tandem_serve.gpu_worker.tiny_model import ensure_default_model

        model = str(ensure_default_model())
    if args.step:
        return step_main(args, model)
    ids = [f"bench-{i}" for i in range(args.adapters)]
    arms: dict[str, dict[str, Any]] = {"base model": {"adapters": []},
                                       "1 adapter": {"adapters": ids[:1]},
                                       f"{args.adapters} adapters": {"adapters": ids}}

    def check(name: str, r: dict[str, Any]) -> None:
        if r["completed"] != args.num_prompts:
            errors = [e for e in r.get("errors", []) if e]
            raise SystemExit(f"tandem bench lora: {name}: {args.num_prompts - r['completed']} "
                             f"requests failed: {errors[:1]}")

    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as cache:
        shapes = model_shapes(model)
        for i, adapter_id in enumerate(ids):
            write_adapter(os.path.join(cache, adapter_id), shapes, args.rank, seed=i)
        extra = ["--adapter-cache", cache, "--max-loras", str(max(args.adapters, 1)),
                 "--max-lora-rank", str(args.rank)]
        runs = run_one_server_arms("lora", model, args, extra, arms, check)
    print(paired_table(runs, "base model", COLUMNS))
    results = {name: median_result(rs) for name, rs in runs.items()}
    keep = [k for k, _ in COLUMNS] + ["completed", "median_tpot_ms", "p99_tpot_ms", "repeats"]
    with open(args.output_json, "w") as f:
        json.dump({n: {k: r.get(k) for k in keep} for n, r in results.items()}, f, indent=2)
    print(f"wrote {args.output_json}", file=sys.stderr)
    return 0
