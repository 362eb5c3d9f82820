"""`--speculative-config`: speculative decoding's settings, spelled as vLLM spells them.

The flag's value is a JSON object, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method": "draft_model", "model":
"DIR", "num_speculative_tokens": 3}`` (a smaller checkpoint with the target's tokenizer).
`ServerConfig` keeps the text (it travels as JSON to every process) and each process parses
it with `parse_speculative`, which names the key and its limit on bad input;
`speculative_problems` also reads the draft's config.json against the target's at start.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 32
# Each method's keys: another method's key is a mistake, not something to ignore.
# `adaptive` is Tandem's own: each plan speculates only on the rows where it pays on this
# device (measured, `gpu_worker.spec.policy`); false speculates on every eligible row, as
# vLLM does.  The worker builds each method's proposer from `gpu_worker.spec.registry`,
# whose methods are these (tests/gpu_worker/test_spec_proposer.py).
_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "adaptive"),
    "draft_model": ("method", "num_speculative_tokens", "model", "adaptive"),
}
METHODS = tuple(_KEYS)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: draft tokens verified per row per step
    prompt_lookup_max: int = 0  # ngram: the longest suffix n-gram looked up in the history
    prompt_lookup_min: int = 0  # ngram: the shortest
    model: str = ""  # draft_model: the draft checkpoint's folder
    adaptive: bool = True  # speculate only where it pays (false: every eligible row)


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
    method = raw.get("method")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not one of "
                         f"{', '.join(METHODS)}")
    keys = _KEYS[method]
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key {unknown[0]!r} for method "
                         f"{method!r} (known: {', '.join(keys)})")
    k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    adaptive = raw.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"--speculative-config: adaptive must be true or false (got "
                         f"{adaptive!r})")
    if method == "draft_model":
        model = raw.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError("--speculative-config: model is required for method "
                             "'draft_model' (the draft checkpoint's folder)")
        return SpeculativeConfig(method, k, model=model, adaptive=adaptive)
    high = _int(raw, "prompt_lookup_max", 4, 1, MAX_LOOKUP)
    low = _int(raw, "prompt_lookup_min", min(2, high), 1, MAX_LOOKUP)
    if low > high:
        raise ValueError(f"--speculative-config: prompt_lookup_min ({low}) must not exceed "
                         f"prompt_lookup_max ({high})")
    return SpeculativeConfig(method, k, high, low, adaptive=adaptive)


def _int(raw: dict, key: str, default: int | None, low: int, high: int) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"--speculative-config: {key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"--speculative-config: {key} must be an integer between {low} and "
                         f"{high} (got {value!r})")
    return value


def vocab_size(model_dir: str) -> int | None:
    """config.json's vocab_size (a multimodal config's text part's); None: unreadable."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    value = raw.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def speculative_problems(text: str, target: str = "") -> list[str]:
    """What is wrong with the flag's value, and with its draft checkpoint against the
    `target` model's folder (a target whose config cannot be read is preflight's to report)."""
    try:
        cfg = parse_speculative(text)
    except ValueError as exc:
        return [str(exc)]
    if cfg is None or cfg.method != "draft_model":
        return []
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        return [f"--speculative-config: model {cfg.model!r} has no config.json (a draft "
                "checkpoint's folder is expected)"]
    draft = vocab_size(cfg.model)
    if draft is None:
        return [f"--speculative-config: model {cfg.model!r}: config.json has no integer "
                "vocab_size"]
    want = vocab_size(target) if target else None
    if want is not None and draft != want:
        return [f"--speculative-config: model {cfg.model!r} has vocab_size {draft}, the "
                f"target {target!r} has {want}: the draft must share the target's tokenizer"]
    return []
