"""What a valid request is, whichever API it came in by: the limits, the errors, the prompt check.

The gRPC service (`rpc/params.py`) and the OpenAI-compatible API (`openai_api/chat/params.py`)
each turn their own parameters into the same `ValidatedRequest` under the same `Limits`.
Every rejection names the field and the limit: `ValidationError` is INVALID_ARGUMENT (HTTP
400).
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem_serve.guided.spec import GuidedSpec
from tandem_serve.proto.request_params import OutputOptions, SamplingParams

MAX_STOP_SEQUENCES = 6
MAX_STOP_SEQUENCE_BYTES = 240
MAX_TOP_N_TOKENS = 10
MAX_REPETITION_PENALTY = 2.0

# A status message travels as gRPC trailing metadata, which clients refuse past 16 KiB (as
# RESOURCE_EXHAUSTED, hiding the real answer): a value the client sent is quoted in part.
MAX_DETAILS = 1000


def shown(value: str, limit: int = 60) -> str:
    """`value` quoted for an error message, cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def capped(message: str) -> str:
    return message if len(message) <= MAX_DETAILS else message[:MAX_DETAILS] + "..."


class ValidationError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(capped(f"{field}: {message}"))
        self.field = field


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_new_tokens: int  # the server's cap for one request
    default_max_new_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    include_stop_sequence: bool  # default when the request leaves it unset
    priority_scheduling: bool = False  # --scheduling-policy priority: `priority` may be set


PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


def check_priority(priority: int, limits: Limits) -> int:
    """A request's scheduling priority: 0 always; anything else needs the priority policy."""
    if priority == 0:
        return 0
    if not limits.priority_scheduling:
        raise ValidationError("priority", f"must be 0 unless the server runs with "
                                          f"--scheduling-policy priority, got {priority}")
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise ValidationError("priority", f"must be a 32-bit integer in [{low}, {high}], "
                                          f"got {priority}")
    return priority


@dataclass
class ValidatedRequest:
    """A validated request, before its prompt is checked against the model's length."""

    sampling: SamplingParams
    options: OutputOptions
    time_limit: float | None  # seconds
    truncate_input_tokens: int
    input_text: bool
    input_tokens: bool
    seed_returned: int  # 0 for greedy
    # Which parts of the input tokens' TokenInfo to fill from the prompt logprobs.
    input_logprobs: bool = False
    input_ranks: bool = False
    input_top_n: int = 0
    # The output constraint (guided decoding), to be compiled before submitting; None: none.
    guided: GuidedSpec | None = None


def check_prompt(num_tokens: int, min_new_tokens: int, limits: Limits,
                 field: str = "requests.text") -> None:
    if num_tokens == 0:
        raise ValidationError(field, "must not be empty")
    if num_tokens >= limits.max_model_len:
        raise ValidationError(field, f"prompt has {num_tokens} tokens; it must be shorter than "
                                     f"the max model length {limits.max_model_len}")
    if num_tokens + min_new_tokens > limits.max_model_len:
        raise ValidationError(field, f"prompt ({num_tokens} tokens) + min_new_tokens "
                                     f"({min_new_tokens}) exceeds the max model length "
                                     f"{limits.max_model_len}")
