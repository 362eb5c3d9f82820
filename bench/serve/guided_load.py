"""Guided-decoding load for `tandem bench serve --guided KIND --guided-share F`.

A seeded share of the requests carries a constraint of one kind, with a hint in front of its
prompt: a US phone number (regex), a colour (choice), a small person record (JSON schema),
a sum of small numbers (GBNF grammar) or any JSON object (format=JSON). Such a request ends
when its constraint is satisfied (EOS), so it has no min_new_tokens.

Every run makes its constraint text unique with a no-op (a `(?:tag){0}` group, a `$comment`,
a grammar comment), so the first guided request compiles from a cold cache; its time to
first token, which includes the compile, is reported apart from the other guided requests'.
Choices and format=JSON have no such no-op: theirs may come from the cache (a choice compiles
in milliseconds; format=JSON may have been precompiled at start-up).
"""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.metrics import WIDTH, RequestRecord

KINDS = ("regex", "choice", "json", "grammar", "json-object")

PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"}},
          "required": ["name", "age"]}
ARITHMETIC = ('root ::= expr\n'
              'expr ::= term (" " ("+" | "-") " " term){0,4}\n'
              'term ::= [1-9] [0-9]?\n')
HINTS = {"regex": "Phone number: ", "choice": "Favourite colour: ", "json": "Person as JSON: ",
         "grammar": "A sum: ", "json-object": "Answer in JSON: "}


def constraint(kind: str, tag: str) -> dict[str, Any]:
    """The GenerateOptions fields of one guided request; `tag` makes the text unique."""
    if kind == "regex":
        return {"regex": f"{PHONE}(?:{tag}){{0}}"}
    if kind == "choice":
        return {"choices": list(COLOURS)}
    if kind == "json":
        return {"json_schema": json.dumps({"$comment": f"bench {tag}", **PERSON})}
    if kind == "grammar":
        return {"grammar": f"# bench {tag}\n{ARITHMETIC}"}
    if kind == "json-object":
        return {"response_format": "json"}
    raise ValueError(f"unknown guided kind {kind!r}; choose one of {', '.join(KINDS)}")


def apply(items: Sequence[BenchItem], kind: str, share: float, seed: int) -> list[BenchItem]:
    """`share` of the items (seeded choice) guided by `kind`, the first of them among them."""
    if not kind or share <= 0:
        return list(items)
    if not 0 < share <= 1:
        raise ValueError(f"--guided-share must be in (0, 1], got {share}")
    rng = random.Random(seed)
    count = max(1, round(share * len(items)))
    chosen = set(rng.sample(range(len(items)), count))
    tag = f"t{time.time_ns():x}"
    fields = constraint(kind, tag)
    return [dataclasses.replace(item, prompt=HINTS[kind] + item.prompt, guided=fields)
            if item.index in chosen else item for item in items]


def summary(items: Sequence[BenchItem], records: Sequence[RequestRecord], kind: str,
            share: float) -> dict[str, Any]:
    """The guided part of the result JSON: the cold first request apart from the rest."""
    guided = [(it, r) for it, r in zip(items, records, strict=True) if it.guided]
    plain = [r for it, r in zip(items, records, strict=True) if not it.guided]
    ok = [r for _, r in guided if r.success]
    first = min(guided, key=lambda ir: ir[1].send_time)[1] if guided else None
    rest = [r for r in ok if r is not first]

    def median_ms(rs: Sequence[RequestRecord], what: str) -> float | None:
        values = [getattr(r, what) * 1000 for r in rs if r.chunk_times]
        return statistics.median(values) if values else None

    errors = [r.error for _, r in guided if not r.success]
    return {
        "guided_kind": kind, "guided_share": share, "guided_requests": len(guided),
        "guided_failed": len(errors), "guided_first_error": errors[0] if errors else "",
        "guided_first_ttft_ms": first.ttft * 1000 if first and first.success else None,
        "guided_median_ttft_ms": median_ms(rest, "ttft"),
        "guided_median_e2el_ms": statistics.median(
            [(r.end_time - r.send_time) * 1000 for r in ok]) if ok else None,
        "guided_mean_output_tokens": statistics.mean(r.output_tokens for r in ok) if ok
        else None,
        "unguided_median_ttft_ms": median_ms([r for r in plain if r.success], "ttft"),
        "guided_samples": [r.generated_text for r in ok[:3]],
    }


def format_summary(result: dict[str, Any]) -> str:
    """The guided block printed under vLLM's result block."""
    def line(label: str, value: Any) -> str:
        shown = "-" if value is None else f"{value:.2f}" if isinstance(value, float) \
            else str(value)
        return f"{label:<40}{shown:<10}"

    lines = [f"{' Guided decoding (' + result['guided_kind'] + ') ':-^{WIDTH}}",
             line("Guided requests:", result["guided_requests"]),
             line("Failed guided requests:", result["guided_failed"]),
             line("First guided TTFT, cold compile (ms):", result["guided_first_ttft_ms"]),
             line("Median guided TTFT, others (ms):", result["guided_median_ttft_ms"]),
             line("Median unguided TTFT (ms):", result["unguided_median_ttft_ms"]),
             line("Median guided E2EL (ms):", result["guided_median_e2el_ms"]),
             line("Mean guided output tokens:", result["guided_mean_output_tokens"])]
    lines += [f"  sample: {text!r}" for text in result["guided_samples"]]
    if result["guided_first_error"]:
        lines.append(f"  first error: {result['guided_first_error']}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)
