"""`--speculative-config`: speculative decoding's settings, spelled as vLLM spells them.

The flag's value is a JSON object, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}``.  `ServerConfig` keeps the text (it travels
as JSON to every process) and each process parses it with `parse_speculative`, which names
the key and its limit on bad input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)  # "draft_model": later
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 32
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: draft tokens verified per row per step
    prompt_lookup_max: int  # the longest suffix n-gram looked up in the row's history
    prompt_lookup_min: int  # the shortest


def parse_speculative(text: str) -> SpeculativeConfig | None:
    """The config in `text` ("": speculation off); ValueError naming the bad key."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(_KEYS)})")
    method = raw.get("method")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not one of "
                         f"{', '.join(METHODS)}")
    k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    high = _int(raw, "prompt_lookup_max", 4, 1, MAX_LOOKUP)
    low = _int(raw, "prompt_lookup_min", min(2, high), 1, MAX_LOOKUP)
    if low > high:
        raise ValueError(f"--speculative-config: prompt_lookup_min ({low}) must not exceed "
                         f"prompt_lookup_max ({high})")
    return SpeculativeConfig(method, k, high, low)


def _int(raw: dict, key: str, default: int | None, low: int, high: int) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"--speculative-config: {key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"--speculative-config: {key} must be an integer between {low} and "
                         f"{high} (got {value!r})")
    return value


def speculative_problems(text: str) -> list[str]:
    try:
        parse_speculative(text)
    except ValueError as exc:
        return [str(exc)]
    return []
