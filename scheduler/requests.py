"""Request state as the scheduler predicts it, and the ledger of tokens the worker produced.

The scheduler never sees output token ids.  It predicts each request's history length at the
gpu worker from counts alone: a plan of K steps adds exactly K tokens to every decoding
request, capped by max_new_tokens and max_model_len (the worker stops there itself).  Only
EOS / stop ids, stop strings and aborts end a request earlier, and those arrive as messages.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tandem_serve.proto.request_params import FinishReason, ImageInput, SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"  # never sent to the worker
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; the worker keeps its token history
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: np.ndarray  # int32
    sampling: SamplingParams
    arrival_time: float
    max_model_len: int
    prompt_block_hashes: list[bytes] = field(default_factory=list)  # full prompt blocks only
    status: RequestStatus = RequestStatus.WAITING
    num_tokens: int = 0  # predicted history length (prompt + generated) after every built plan
    num_computed: int = 0  # predicted positions whose KV is in the cache after every built plan
    blocks: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading prompt blocks already in (or taken from) the cache
    known_to_worker: bool = False  # the worker holds state for it until a plan drops it
    num_preemptions: int = 0
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    adapter_id: str = ""  # its LoRA adapter ("": the base model)
    lora_slot: int = 0  # the adapter slot it holds from admission to finish (0: none)
    images: list[ImageInput] = field(default_factory=list)  # until sent to the worker
    # [start, end) of the images whose tokens attend to each other both ways (Gemma 3): no
    # chunk and no prefix hit ends inside one (`budget.Split`, `cached_blocks`).
    whole_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_tokens = self.prompt_len
        self.whole_spans = sorted((im.offset, im.offset + im.length) for im in self.images
                                  if im.bidirectional)

    def cached_blocks(self, blocks: int, block_size: int) -> int:
        """How many of `blocks` leading cached blocks a prefix hit may use: the hit ends
        at an image's start rather than inside it, since the image's tokens must be
        computed in one forward (a hit covering the whole image is fine: its KV was
        computed that way)."""
        end = blocks * block_size
        for start, stop in reversed(self.whole_spans):  # a cut may land in an earlier one
            if start < end < stop:
                end = start // block_size * block_size
        return end // block_size

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def max_tokens(self) -> int:
        """History length at which the worker finishes the request by itself."""
        return min(self.prompt_len + self.sampling.max_new_tokens, self.max_model_len)

    @property
    def steps_left(self) -> int:
        return self.max_tokens - self.num_tokens

    @property
    def prefill_left(self) -> int:
        # The last history token is never prefilled: the first decode step consumes it.
        return self.num_tokens - 1 - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.prefill_left > 0

    def count_finish(self) -> FinishReason | None:
        """The finish the worker reaches on its own, known from counts alone."""
        if self.num_generated >= self.sampling.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if self.num_tokens >= self.max_model_len:
            return FinishReason.TOKEN_LIMIT
        return None


@dataclass
class _Tally:
    produced: int = 0
    limit: int | None = None  # tokens the client keeps; None while the request runs on


class TokenLedger:
    """Splits the tokens the worker reports into delivered ones and ones made after a finish.

    A stop string or an abort is learned late, so the worker keeps producing tokens for a
    while: those beyond the cut are waste.  Reports arrive in any order (a StopHit can come
    before or after the StepDone that carried its tokens), so a cut moves tokens already
    counted as delivered over to waste.  A tally is kept until no message can mention the
    request any more: the plan that dropped it has been done and processed.
    """

    def __init__(self) -> None:
        self.tokens_delivered = 0
        self.tokens_after_finish = 0
        self._tallies: dict[int, _Tally] = {}
        self._forget_after_plan: dict[int, list[int]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self._tallies)

    def open(self, request_id: int) -> None:
        self._tallies.setdefault(request_id, _Tally())

    def add_produced(self, request_id: int, num_tokens: int) -> None:
        tally = self._tallies.get(request_id)
        if tally is None:  # never expected: every plan naming it ends before its tally goes
            self.tokens_delivered += num_tokens
            return
        kept_before = self._kept(tally)
        tally.produced += num_tokens
        kept = self._kept(tally) - kept_before
        self.tokens_delivered += kept
        self.tokens_after_finish += num_tokens - kept

    def cut(self, request_id: int, limit: int | None = None) -> None:
        """The client keeps at most `limit` tokens (None: what was produced so far)."""
        tally = self._tallies.get(request_id)
        if tally is None:
            return
        new_limit = tally.produced if limit is None else limit
        if tally.limit is not None and tally.limit <= new_limit:
            return
        kept_before = self._kept(tally)
        tally.limit = new_limit
        moved = kept_before - self._kept(tally)
        self.tokens_delivered -= moved
        self.tokens_after_finish += moved

    def forget_after(self, plan_id: int, request_ids: list[int]) -> None:
        self._forget_after_plan[plan_id].extend(request_ids)

    def plan_complete(self, plan_id: int) -> None:
        for request_id in self._forget_after_plan.pop(plan_id, []):
            self._tallies.pop(request_id, None)

    @staticmethod
    def _kept(tally: _Tally) -> int:
        return tally.produced if tally.limit is None else min(tally.produced, tally.limit)
