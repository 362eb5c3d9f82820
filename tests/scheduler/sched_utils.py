"""Helpers for the scripted scheduler tests: a small cache, requests and StepDone messages."""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.plan_messages import StepDone
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.scheduler.core import Scheduler, SchedulerParams


def add(sched: Scheduler, rid: int, prompt: list[int] | int, max_new: int = 8) -> None:
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    msg = AddRequest(rid, np.array(ids, dtype=np.int32), SamplingParams(max_new_tokens=max_new),
                     0.0)
    assert sched.add_request(msg) is None


def step_done(plan_id: int, finished: dict[int, FinishReason] | None = None,
              tokens: dict[int, int] | None = None) -> StepDone:
    finished, tokens = finished or {}, tokens or {}
    return StepDone(plan_id, np.array(list(tokens), dtype=np.int64),
                    np.array(list(tokens.values()), dtype=np.int32),
                    np.array(list(finished), dtype=np.int64),
                    np.array([int(r) for r in finished.values()], dtype=np.uint8), 0.0, 0.0)


def params(**overrides: object) -> SchedulerParams:
    values: dict[str, object] = dict(num_blocks=64, block_size=4, num_steps=4, max_model_len=64,
                                     num_postproc_workers=1)
    values.update(overrides)
    return SchedulerParams(**values)  # type: ignore[arg-type]
