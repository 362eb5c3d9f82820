"""vLLM's `SamplingParams`, `RequestOutput` and `CompletionOutput` shapes, for the offline
`LLM` (`tandem/offline/llm.py`).

`SamplingParams` is turned into the OpenAI completions (or chat) request body the HTTP API
validates (`openai_api/chat/params.py`), so a parameter means the same thing offline as over
HTTP, under the same limits, and a bad value raises a `ValueError` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """vLLM's field names and defaults (`max_tokens` 16; None: up to the model length, at most
    the server's --max-new-tokens).  `top_k` -1 or 0 is off.  With `n > 1` and a `seed`,
    sample i uses seed + i, so a seeded call is reproducible."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token (0: the chosen one's only)
    skip_special_tokens: bool = True

    def body(self) -> dict[str, Any]:
        """The fields as an OpenAI request body's (completions' logprobs convention)."""
        out: dict[str, Any] = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "max_tokens": self.max_tokens, "min_tokens": self.min_tokens, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, "logprobs": self.logprobs}
        return out


@dataclass
class Logprob:
    """One token's log probability, its rank in the distribution (1: the most likely), and
    its text (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's field names)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per token: the chosen one and the top N
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string that ended it, if one did

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's outputs (vLLM's field names); `prompt` is None for token-id prompts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
