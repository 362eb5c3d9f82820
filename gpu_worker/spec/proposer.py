"""What a speculative decoding method provides: the `Proposer` interface.

A method proposes each verify step's drafts; everything else (which rows speculate, the
verify forward, sampling, acceptance, the counters) is the same for every method
(`gpu_worker.spec.policy`, `gpu_worker.spec.verify`).  One module per method implements this
interface (`gpu_worker.spec.ngram`, `gpu_worker.spec.draft_model`) and one line of
`gpu_worker.spec.registry` maps the speculative config's `method` to its factory.

A proposer lives as long as the runner; what it keeps per request lives on the
`RequestState` (the draft model's `draft_len`), and what it reads per step comes in a
`DraftInputs`.  It imports neither the decode batch nor the plan's `SpecBatch`, so both can
hold it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem_serve.gpu_worker.attention.base import AttentionBackend
from tandem_serve.gpu_worker.state import RequestState

# The wall time of one forward over n rows -> that time as the policy reads it (measured at
# powers of two, agreed between tensor-parallel ranks: `gpu_worker.spec.policy.StepCost`).
Timed = Callable[[Callable[[int], float]], Callable[[int], float]]


@dataclass(frozen=True)
class ProposerContext:
    """The target's settings a proposer is built with (a draft checkpoint loads as the target
    did, and must share its vocabulary)."""

    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    onednn: bool = True
    load_format: str = "auto"


@dataclass
class DraftInputs:
    """What a proposer sees of one verify step: the S speculating rows, in the plan's order
    (`SpecBatch.chosen`).  All tensors are on the device; the ints are host bounds the plan
    already knows, so proposing reads nothing back."""

    k: int  # drafts per row
    history: Tensor  # [S, L] int64: prompt + output so far, -1 past hist_len
    hist_len: Tensor  # [S] int64
    capacity: Tensor  # [S] int64: positions the row's KV blocks hold
    input_ids: Tensor  # [S] int64: the token each row feeds this step
    positions: Tensor  # [S] int64: its position
    active: Tensor  # [S] bool: the row decodes in this step
    block_tables: Tensor  # [S, nb] int32
    bound: int  # every row's context length in this step is at most this
    lens: list[int]  # the same bound per row


class Proposer(ABC):
    """A speculative decoding method (the module doc).  Only `propose` is required; the hooks
    default to what a method with no model and no KV cache of its own needs: nothing."""

    @abstractmethod
    def propose(self, rows: DraftInputs) -> tuple[Tensor, Tensor]:
        """Drafts [S, k] (int64, anything past a row's length) and how many of them each row
        offers [S] (int64, 0: none), by tensor ops on the device with no host read (the
        K-step loop must not wait for the host).  The verify step caps the lengths where
        tokens could never be kept (KV blocks, max_new_tokens, max_model_len)."""

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes the method's own KV cache adds to each of the target's blocks (counted when
        the cache is sized from memory)."""
        return 0

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 attention: AttentionBackend) -> None:
        """Allocate the method's own KV cache once the target's block count is known (its
        blocks mirror the target's ids and tables); it attends with the target's backend
        (`attention`, chosen at start-up)."""
        return None

    def step_cost(self, k: int, timed: Timed) -> Callable[[int], float] | None:
        """The seconds proposing adds to a verify step with S speculating rows, as the
        policy weighs it against accepted drafts (`timed` wraps a forward's wall time as the
        target's is measured); None: too little to count."""
        return None

    def start_plan(self, reqs: list[RequestState]) -> None:
        """Host work before a plan in which `reqs` speculate, after their device state is
        built (the draft model prefills what its cache lacks)."""
        return None

    def end_plan(self, reqs: list[RequestState]) -> None:
        """After the plan's host read: fold what the plan did into `reqs`' host state."""
        return None

    def preempted(self, req: RequestState) -> None:
        """`req` lost its KV blocks: forget what the method holds of it (it resumes from
        position 0)."""
        return None
