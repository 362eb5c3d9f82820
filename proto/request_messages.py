"""The frontend's channels: requests in and out of the scheduler (frontend -> scheduler, and its
rejections and failures back), and a request's output options to its postproc worker.

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import (
    FinishReason,
    ImageInput,
    OutputOptions,
    SamplingParams,
)


@dataclass
class AddRequest:
    request_id: int
    prompt_ids: np.ndarray  # int32
    sampling: SamplingParams
    arrival_time: float  # time.monotonic() of the frontend when the RPC arrived
    # The compiled constraint named by sampling.guided_id, when the sender puts it in the
    # request.  The frontend never does (None): it sends each table as a message of its own,
    # once per id, and again when the scheduler asks (`GuidedWanted`).
    guided: GuidedTable | GuidedGrammar | None = None
    adapter_id: str = ""  # a LoRA adapter the frontend validated ("": the base model)
    images: list[ImageInput] = field(default_factory=list)  # a VL model's, in prompt order


@dataclass
class AbortRequest:
    request_id: int
    reason: FinishReason = FinishReason.CANCELLED


@dataclass
class RequestRejected:
    """Admission control said no; the frontend answers RESOURCE_EXHAUSTED."""

    request_id: int
    message: str


@dataclass
class RequestFailed:
    """The scheduler ended a request that no token will ever finish (e.g. cannot fit)."""

    request_id: int
    reason: FinishReason
    message: str
    # A gRPC status name when the request fails as an error (e.g. INVALID_ARGUMENT: its
    # adapter could not be loaded) rather than ending with `reason`.
    code: str = ""


@dataclass
class RegisterRequest:
    """Sent to the owning postproc worker before the request reaches the scheduler."""

    request_id: int
    prompt_ids: np.ndarray  # int32; context for the detokenizer's first tokens
    options: OutputOptions
    max_new_tokens: int


@dataclass
class ForgetRequest:
    """The request ended outside the token stream (cancel, time limit); drop its state."""

    request_id: int
