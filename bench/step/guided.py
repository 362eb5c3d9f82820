"""`tandem bench step --guided`: what guided rows cost a decode step.

The same batch of prompts decodes through `ModelRunner.execute` (`runner.Ours` of `bench step`,
K-step plans, every step published) once with no guided rows and once per constraint kind
with `--guided-share` of its rows guided: a regex, a choice and a JSON schema (device tables,
built with outlines-core by `harness.guided_tables`) and a grammar (llguidance on the host: the
same JSON schema as a Lark `%json` rule).  Every row is greedy and has no stop id, so the
batch stays full for every timed step (a constraint that completes goes on forcing EOS,
which costs the same mask work).  Each arm has its own runner and the arms' plans take
turns, so every round compares them under the same load; the figures are each arm's median
ms/step, the median of its per-round ratio to the unguided plan, and the fastest plans.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tandem_serve.bench.step.runner import Ours, progress, random_prompts
from tandem_serve.harness.guided_tables import choice_regex, json_schema_regex, regex_table
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import GuidedKind, SamplingParams
from tandem_serve.tokenization.tokenizer import Tokenizer

REGEX = r"(\d{4}-\d{2}-\d{2}|[A-Z][a-z]+ [0-9]{1,2}, [0-9]{4})(; [A-Za-z ,.]{1,40})*"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable", "unknown",
           "strongly positive", "strongly negative"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "email": {"type": "string", "maxLength": 30},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "maxItems": 3},
                         "active": {"type": "boolean"}},
          "required": ["name", "age", "email", "tags", "active"]}
KINDS = ("regex", "choice", "json", "grammar")


@dataclass
class GuidedRow:
    batch: int
    arm: str  # "unguided" or a kind
    guided_rows: int
    ms: float  # median ms/step
    ratio: float  # median over rounds of ms/step over the same round's unguided plan
    detail: str = ""  # the table's states x classes, or "host"
    min_ms: float = 0.0  # fastest plan: what a quiet machine gives
    min_ratio: float = 0.0


def constraints(model: str, vocab_size: int) -> dict[str, GuidedTable | GuidedGrammar]:
    tok = Tokenizer.from_dir(model)
    out: dict[str, GuidedTable | GuidedGrammar] = {
        "regex": regex_table(REGEX, tok, vocab_size),
        "choice": regex_table(choice_regex(CHOICES), tok, vocab_size),
        "json": regex_table(json_schema_regex(SCHEMA), tok, vocab_size)}
    out["grammar"] = GuidedGrammar("bench-json-grammar", "start: %json " + json.dumps(SCHEMA))
    return out


def _sampling(item: GuidedTable | GuidedGrammar | None) -> SamplingParams:
    params = SamplingParams(max_new_tokens=1 << 30)
    if isinstance(item, GuidedTable):
        params.guided_kind, params.guided_id = GuidedKind.TABLE, item.table_id
    elif isinstance(item, GuidedGrammar):
        params.guided_kind, params.guided_id = GuidedKind.GRAMMAR, item.grammar_id
    return params


def guided_mask(batch: int, share: float) -> list[bool]:
    """Which rows are guided: `share` of them, spread over the batch."""
    return [int((i + 1) * share) > int(i * share) for i in range(batch)]


def _detail(item: GuidedTable | GuidedGrammar) -> str:
    if isinstance(item, GuidedTable):
        states, classes = item.next_state.shape
        return f"{states - 1} states x {classes} classes"
    return "llguidance on the host"


def measure_guided(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
                   repeats: int, share: float) -> list[GuidedRow]:
    arms = ["unguided", *KINDS]
    plans = repeats * -(-steps // k)
    # One runner per arm, all decoding at once: plans of the arms take turns, so each round
    # compares arms under the same load (a shared machine swings by 2x within seconds).
    runners = {arm: Ours(model, max(batches), prompt_len + (plans + 2) * k, k) for arm in arms}
    vocab = runners["unguided"].runner.vocab_size
    items = constraints(model, vocab)
    rows: list[GuidedRow] = []
    try:
        for b in batches:
            prompts = random_prompts(b, prompt_len, vocab)
            mask = guided_mask(b, share)
            for arm, ours in runners.items():
                item = items.get(arm)
                sampling = [_sampling(item if on else None) for on in mask]
                tables = [item] if item is not None and b == batches[0] else []
                ours.samples(prompts, k, sampling, tables=tables)  # prefill and a warm-up plan
            got: dict[str, list[float]] = {arm: [] for arm in arms}
            for r in range(plans):
                for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
                    t0 = time.perf_counter()
                    runners[arm].execute(k)
                    got[arm].append((time.perf_counter() - t0) / k * 1e3)
            rows += _rows(b, sum(mask), got, items)
    finally:
        for ours in runners.values():
            ours.close()
    return rows


def _rows(batch: int, guided_rows: int, got: dict[str, list[float]],
          items: dict[str, GuidedTable | GuidedGrammar]) -> list[GuidedRow]:
    """Per arm: median ms/step, and the median over rounds of its ratio to the unguided plan
    of the same round."""
    base = np.array(got["unguided"])
    out = []
    for arm, samples in got.items():
        ms = np.array(samples)
        item = items.get(arm)
        row = GuidedRow(batch, arm, 0 if item is None else guided_rows, float(np.median(ms)),
                        float(np.median(ms / base)), "" if item is None else _detail(item),
                        float(ms.min()), float(ms.min() / base.min()))
        rows_note = f"{row.ms:.2f} ms/step ({row.ratio:.3f}x)"
        progress(f"batch {batch}: {arm} {rows_note}")
        out.append(row)
    return out


def format_guided_table(rows: list[GuidedRow]) -> str:
    lines = ["| batch | rows guided | kind | constraint | ms/step (median) | × unguided | "
             "ms/step (fastest plan) | × unguided |", "|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.guided_rows} | {r.arm} | {r.detail or '-'} | "
                     f"{r.ms:.2f} | {r.ratio:.3f} | {r.min_ms:.2f} | {r.min_ratio:.3f} |")
    return "\n".join(lines)


def run(model: str, batches: list[int], args: argparse.Namespace) -> int:
    import torch

    if not 0.0 < args.guided_share <= 1.0:
        raise SystemExit(f"--guided-share={args.guided_share} must be in (0, 1]")
    rows = measure_guided(model, batches, args.prompt_len, args.steps,
                          args.num_scheduler_steps, args.repeats, args.guided_share)
    print(format_guided_table(rows))
    if args.json:
        report: dict[str, Any] = {
            "model": args.model or f"tiny-{args.preset}", "threads": torch.get_num_threads(),
            "prompt_len": args.prompt_len, "decode_steps": args.steps,
            "num_scheduler_steps": args.num_scheduler_steps, "share": args.guided_share,
            "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    sys.stdout.flush()
    return 0
