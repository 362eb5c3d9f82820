"""The stall scenario in one process, on a clock of the worker's own CPU time.

A real `Scheduler` plans for a real `ModelRunner` (as `tandem serve` would configure them
on a CPU) and a virtual clock advances by the thread CPU time each step took, so the
figures are what the device did, whatever else the machine runs: on a shared host a
wall-clock stall of a served run is as often a neighbour's job as ours.  What the clock
leaves out is equal for both arms: postprocessing and IPC run beside the steps, and the
token's trip to the client.  Plans are built when the previous one ends (paced planning),
so a prompt arriving during a plan joins the next one.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from tandem_serve.bench.stall.scenario import StallWorkload, Stamps, text_of
from tandem_serve.ipc.process import freeze_heap


class Clock:
    """Virtual seconds: the worker thread's CPU time while it runs plans."""

    def __init__(self) -> None:
        self.now = 0.0
        self._plan_at = (0.0, 0.0)  # (virtual time, thread time) when the plan started

    def start_plan(self) -> None:
        self._plan_at = (self.now, time.thread_time())

    def in_plan(self) -> float:
        at, cpu = self._plan_at
        return at + time.thread_time() - cpu


def run(model: str, tokenizer: Any, work: StallWorkload, seed: int, num_steps: int,
        prefill_phase: bool, budget: int) -> Stamps:
    import torch

    from tandem_serve.gpu_worker.publisher import TokenPublisher
    from tandem_serve.gpu_worker.runner import ModelRunner
    from tandem_serve.gpu_worker.steps import attention_tokens
    from tandem_serve.proto.config import WorkerConfig
    from tandem_serve.proto.request_params import SamplingParams
    from tandem_serve.proto.token_messages import PlanProcessed, TokenBatch
    from tandem_serve.scheduler.budget import default_tokens
    from tandem_serve.scheduler.core import Scheduler, SchedulerParams

    torch.set_num_threads(1)
    runner = ModelRunner(WorkerConfig(model, device="cpu", dtype="float32", num_kv_blocks=1200))
    sched = Scheduler(SchedulerParams(
        num_blocks=runner.num_blocks, block_size=runner.block_size, num_steps=num_steps,
        max_model_len=runner.max_model_len, prefill_phase=prefill_phase,
        max_num_batched_tokens=budget or default_tokens("cpu", prefill_phase),
        attention_tokens=attention_tokens(runner.model.config),
        num_postproc_workers=1))
    freeze_heap()  # as a served worker does once started: no full collection mid-plan
    clock = Clock()
    steps: dict[tuple[int, int], float] = {}  # (plan, step) -> when its tokens exist
    decode_step = runner.decode_step
    plan_id = -1

    def stamped(b: Any, step: int, *rest: Any) -> Any:
        out = decode_step(b, step, *rest)
        steps[(plan_id, step)] = clock.in_plan()
        return out

    runner.decode_step = stamped  # type: ignore[method-assign,assignment]
    batches: list[TokenBatch] = []
    publisher = TokenPublisher(lambda m: batches.append(m) if isinstance(m, TokenBatch)
                               else None, runner.device)
    rng = np.random.default_rng(seed)
    arrivals = [(0.0, i, text_of(tokenizer, 12, seed * 1000 + i), work.stream_tokens)
                for i in range(work.streams)]
    start = 0.3  # past the streams' own prefills
    arrivals += [(start + j * work.interval, 100 + j,
                  text_of(tokenizer, work.prompt_len, seed * 1000 + 100 + j), work.prompt_tokens)
                 for j in range(work.prompts)]
    end = start + (work.prompts - 1) * work.interval + 3  # the last prompt is long done
    sent: dict[int, float] = {}
    try:
        while arrivals or sched.ready_to_plan():
            while arrivals and arrivals[0][0] <= clock.now:
                at, rid, text, n = arrivals.pop(0)
                ids = np.array(tokenizer.encode(text), dtype=np.int32)
                sent[rid] = at
                sched.add_request(_request(rid, ids, SamplingParams(
                    max_new_tokens=n, min_new_tokens=n, seed=int(rng.integers(1 << 30)))))
            if not sched.ready_to_plan():
                clock.now = arrivals[0][0]  # idle until the next arrival
                continue
            plan = sched.build_plan()
            plan_id = plan.plan_id
            clock.start_plan()
            done = runner.execute(plan, publisher)
            clock.now = clock.in_plan()
            sched.on_step_done(done)
            sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
            if clock.now > end:
                break  # the streams would run on for their whole length
    finally:
        publisher.close()
    return _stamps(batches, steps, sent, work)


def _request(rid: int, ids: np.ndarray, sampling: Any) -> Any:
    from tandem_serve.proto.request_messages import AddRequest

    return AddRequest(rid, ids, sampling, 0.0)


def _stamps(batches: list[Any], steps: dict[tuple[int, int], float], sent: dict[int, float],
            work: StallWorkload) -> Stamps:
    tokens: dict[int, list[float]] = {}
    for b in batches:
        at = steps.get((b.plan_id, b.step))
        if at is None:
            continue
        for rid, tok in zip(b.request_ids.tolist(), b.token_ids.tolist(), strict=True):
            if tok >= 0:
                tokens.setdefault(rid, []).append(at)
    stamps = Stamps(streams=[tokens.get(i, []) for i in range(work.streams)],
                    prompt_tokens=[tokens.get(100 + j, []) for j in range(work.prompts)])
    stamps.sent = [sent[100 + j] for j in range(work.prompts)]
    stamps.first = [t[0] for t in stamps.prompt_tokens]
    stamps.window = (stamps.sent[0], max(stamps.first) + work.tail)
    return stamps
