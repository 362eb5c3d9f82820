"""The LoRA messages between the scheduler and the gpu worker (listed in
`proto.messages.MESSAGE_TYPES` like every other message)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdapterLoad:
    """Scheduler -> gpu worker, in a StepPlan: load `adapter_id` (a folder under the adapter
    cache) into adapter slot `slot` before the plan's forwards."""

    slot: int  # 1..max_loras
    adapter_id: str


@dataclass
class AdapterFailed:
    """Gpu worker -> scheduler, before the StepDone of plan `plan_id`: an adapter could not be
    loaded, so the plan's requests that use it never ran (the slot stays unusable until a
    later load into it succeeds)."""

    plan_id: int
    adapter_id: str
    slot: int
    message: str
    request_ids: list[int] = field(default_factory=list)
