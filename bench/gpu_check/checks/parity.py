"""The parity stage of `scripts/gpu-check`: greedy tokens of a served model against HF
`generate()`'s on the same checkpoint (float32 with CUDA graphs and eager, bfloat16)."""
from __future__ import annotations

import json
from typing import Any

from tandem_serve.bench.gpu_check.models import tiny_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget
from tandem_serve.harness.arms import Arm, arm_server

PARITY_PROMPTS = [("Once upon a time", 48), ("The quick brown fox jumps over", 32),
                  ("Tandem runs the model while", 40), ("1, 2, 3, 4,", 64)]


def hf_greedy(model: str, device: str, dtype: str,
              jobs: list[tuple[str, int]]) -> list[list[str]]:
    """HF generate()'s greedy tokens (as token strings) for each (prompt, n)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    hf.to(device)
    out: list[list[str]] = []
    for text, n in jobs:
        ids = tok(text, return_tensors="pt").input_ids.to(device)
        gen = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(list(tok.convert_ids_to_tokens(gen[0, ids.shape[1]:].tolist())))
    del hf
    return out


def served_tokens(model: str, flags: list[str], jobs: list[tuple[str, int]]) -> list[list[str]]:
    """Greedy tokens of a fresh async K=8 server of `model` with `flags` for each job."""
    with arm_server(model, Arm(8, True), flags) as served:
        return client_tokens(served.client, jobs)


def client_tokens(client: Any, jobs: list[tuple[str, int]]) -> list[list[str]]:
    """Greedy tokens (as token strings) of the server behind `client`, one job at a time."""
    from tandem_serve.rpc.client import GenerateOptions

    out = []
    for text, n in jobs:
        opts = GenerateOptions(max_new_tokens=n, min_new_tokens=n, generated_tokens=True)
        out.append([t.text for r in client.stream(text, opts) for t in r.tokens])
    return out


def agreement(got: list[list[str]], want: list[list[str]]) -> tuple[int, float]:
    """Prompts whose tokens all match, and the share of tokens before the first mismatch."""
    exact = sum(g == w for g, w in zip(got, want, strict=True))
    prefix = 0
    for g, w in zip(got, want, strict=True):
        prefix += next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                       min(len(g), len(w)))
    return exact, prefix / max(sum(len(w) for w in want), 1)


def stage_parity(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    model = tiny_model(out, plan.parity_model)
    jobs = PARITY_PROMPTS[:plan.parity_prompts]
    base = ["--device", plan.device]
    variants: list[tuple[str, str, list[str]]] = [("float32", "float32", [])]
    if plan.device == "cuda":
        variants += [("float32 --enforce-eager", "float32", ["--enforce-eager"]),
                     ("bfloat16", "bfloat16", [])]
    fig: dict[str, Any] = {}
    rows = ["| server | prompts equal to HF | tokens agreeing |", "|---|---:|---:|"]
    refs: dict[str, list[list[str]]] = {}
    for name, dtype, extra in variants:
        if dtype not in refs:
            refs[dtype] = hf_greedy(model, plan.device, dtype, jobs)
        got = served_tokens(model, [*base, "--dtype", dtype, *extra], jobs)
        exact, share = agreement(got, refs[dtype])
        fig[name] = {"exact": exact, "prompts": len(jobs), "token_agreement": share}
        rows.append(f"| {name} | {exact}/{len(jobs)} | {100 * share:.1f}% |")
    fp32 = [v for k, v in fig.items() if k.startswith("float32")]
    if any(v["exact"] != v["prompts"] for v in fp32):
        raise RuntimeError("float32 greedy output differs from HF generate(): " + json.dumps(fig))
    return fig, "\n".join(rows)
