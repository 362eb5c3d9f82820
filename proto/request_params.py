"""What travels with every request: its sampling parameters and output options, and why it
ended (`FinishReason`, the public `fmaas.StopReason` values).

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class FinishReason(IntEnum):
    """Why a request ended; the numbers are the public `fmaas.StopReason` values."""

    NOT_FINISHED = 0
    MAX_TOKENS = 1
    EOS_TOKEN = 2
    CANCELLED = 3
    TIME_LIMIT = 4
    STOP_SEQUENCE = 5
    TOKEN_LIMIT = 6
    ERROR = 7


class GuidedKind(IntEnum):
    """How a request's output is constrained (guided decoding)."""

    NONE = 0
    TABLE = 1  # regex, choice, JSON schema, any JSON object: an automaton stepped on the device
    GRAMMAR = 2  # a context-free grammar: matched on the gpu worker's host, a bitmask per step


@dataclass
class SamplingParams:
    """What the gpu worker needs to pick tokens and to know when a request is done."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    typical_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    # OpenAI's penalties over the output so far: logit -= frequency * count + presence * seen.
    frequency_penalty: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    seed: int = 0
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids plus request stop ids
    length_penalty_start: int = 0
    length_penalty_decay: float = 1.0  # 1 = off
    logprobs: bool = False  # chosen token's logprob and rank
    top_n: int = 0  # alternatives per token (<= 10)
    prompt_logprobs: bool = False  # logprob/rank/top-n of every prompt token (no prefix cache)
    # Guided decoding: the constraint's kind and content id (GuidedTable.table_id or
    # GuidedGrammar.grammar_id).  The request carries only these: the table itself travels
    # on its own, once per id on each hop (frontend -> scheduler -> gpu worker).
    guided_kind: GuidedKind = GuidedKind.NONE
    guided_id: str = ""
    # OpenAI's logit_bias: added to these tokens' logits before every other processing step,
    # on the device (ids unique, each bias in [-100, 100]).
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    # Scheduling, read by the scheduler only: under --scheduling-policy priority a lower value
    # runs first (ties by arrival); always 0 under fcfs.
    priority: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class OutputOptions:
    """What the postproc worker needs to turn ids into the response a client asked for."""

    stop_sequences: list[str] = field(default_factory=list)
    include_stop_sequence: bool = True
    skip_special_tokens: bool = True
    token_details: bool = False  # TokenInfo per generated token
    logprobs: bool = False
    ranks: bool = False
    top_n: int = 0


@dataclass
class ImageInput:
    """One image of a prompt, preprocessed by the checkpoint's own processor (frontend) and
    encoded by the vision tower on the gpu worker during the request's prefill.

    Its `length` placeholder tokens start at `offset` in the prompt; their embeddings are
    the tower's output rows.  `digest` is a hash of what the tower reads (pixels and grid),
    so equal digests mean equal embeddings: the worker's embedding cache and the
    scheduler's prefix-cache hashes key on it.
    """

    offset: int
    length: int
    digest: bytes  # 16 bytes
    pixel_values: np.ndarray  # float32 [patches, channels * patch volume]
    grid_thw: list[int]  # the tower's grid (temporal, height, width) in patches
    # Its tokens attend to each other both ways during prefill (Gemma 3): the scheduler
    # never ends a chunk or a prefix-cache hit inside it.
    bidirectional: bool = False

