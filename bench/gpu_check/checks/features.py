"""`scripts/gpu-check`'s features stage: guided decoding, LoRA adapters and tensor parallelism
on the device, each against its reference, through a real server.

* a regex-guided greedy request equals HF `generate()` masked by an outlines-core Guide;
* a greedy request under a LoRA adapter equals PEFT's `generate()` on the same base;
* with two or more CUDA devices, a `--tensor-parallel-size 2` server's greedy output equals
  HF's (with one device this part is skipped and says so: NCCL needs a device per rank).

Float32, the tiny default model, so any difference is a bug and not rounding.
"""
from __future__ import annotations

import os
from typing import Any

from tandem_serve.bench.gpu_check.checks.parity import PARITY_PROMPTS, hf_greedy, served_tokens
from tandem_serve.bench.gpu_check.models import tiny_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget
from tandem_serve.harness.arms import Arm, arm_server

REGEX = r"(yes|no), [0-9]{2,4} (apples|pears)\."
PROMPT = "Once upon a time"
NEW = 24


def _hf_model(model: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return hf.to(device).eval()


def _hf_ids(model: str, device: str) -> tuple[Any, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok, tok(PROMPT).input_ids


def hf_regex(model: str, device: str) -> list[str]:
    """HF greedy under REGEX: at each step only what the Guide allows (EOS where complete)."""
    import torch
    from outlines_core import Guide, Index
    from transformers import LogitsProcessorList

    from tandem_serve.harness.guided_tables import vocabulary
    from tandem_serve.tokenization.tokenizer import Tokenizer

    tok, prompt = _hf_ids(model, device)
    ours = Tokenizer.from_dir(model)
    hf = _hf_model(model, device)
    guide = Guide(Index(REGEX, vocabulary(ours)))
    seen = [0]

    def mask(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for t in input_ids[0, len(prompt) + seen[0]:].tolist():
            guide.advance(t, return_tokens=False)
            seen[0] += 1
        keep = torch.full_like(scores, float("-inf"))
        keep[:, list(guide.get_tokens())] = 0.0
        return scores + keep

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW, logits_processor=LogitsProcessorList([mask]))
    gen = [t for t in out[0, len(prompt):].tolist() if t not in ours.eos_token_ids]
    return list(tok.convert_ids_to_tokens(gen))


def peft_greedy(model: str, adapter: str, device: str) -> list[str]:
    import torch
    from peft import PeftModel

    tok, prompt = _hf_ids(model, device)
    hf = PeftModel.from_pretrained(_hf_model(model, device), adapter).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW, min_new_tokens=NEW)
    return list(tok.convert_ids_to_tokens(out[0, len(prompt):].tolist()))


def served(client: Any, *, regex: str | None = None, adapter_id: str = "") -> list[str]:
    from tandem_serve.rpc.client import GenerateOptions

    opts = GenerateOptions(max_new_tokens=NEW, generated_tokens=True, regex=regex,
                           min_new_tokens=0 if regex else NEW)
    return [t.text for r in client.stream(PROMPT, opts, adapter_id=adapter_id)
            for t in r.tokens]


def check_features(model: str, device: str, out: str) -> tuple[dict[str, Any], str]:
    import torch

    from tandem_serve.bench.lora.adapters import model_shapes, write_adapter

    cache = os.path.join(out, "adapters")
    write_adapter(os.path.join(cache, "check"), model_shapes(model), rank=8, seed=7)
    flags = ["--device", device, "--dtype", "float32", "--adapter-cache", cache]
    fig: dict[str, Any] = {}
    with arm_server(model, Arm(8, True), flags) as server:  # one server answers both
        guided = served(server.client, regex=REGEX)
        adapted = served(server.client, adapter_id="check")
    want = hf_regex(model, device)
    # The served tokens include the final EOS's text when the constraint ended it.
    fig["guided_regex"] = {"equal": guided[:len(want)] == want, "tokens": len(want)}
    fig["lora"] = {"equal": adapted == peft_greedy(model, os.path.join(cache, "check"),
                                                   device), "tokens": len(adapted)}
    if device == "cuda" and torch.cuda.device_count() >= 2:
        jobs = PARITY_PROMPTS[:2]
        tp = served_tokens(model, ["--device", "cuda", "--dtype", "float32",
                                   "--tensor-parallel-size", "2"], jobs)
        fig["tensor_parallel_2"] = {"equal": tp == hf_greedy(model, "cuda", "float32", jobs)}
    else:
        fig["tensor_parallel_2"] = {"skipped": "needs two CUDA devices (NCCL: one per rank)"}
    rows = ["| feature | result |", "|---|---|"]
    for name, r in fig.items():
        result = r.get("skipped") or ("equal to its reference" if r["equal"] else "DIFFERS")
        rows.append(f"| {name} | {result} |")
    bad = [n for n, r in fig.items() if r.get("equal") is False]
    if bad:
        raise RuntimeError(f"differs from its reference: {', '.join(bad)}")
    return fig, "\n".join(rows)


def stage_features(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    return check_features(tiny_model(out, "default"), plan.device, out)
