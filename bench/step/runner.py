"""The two sides `tandem bench step` times: ours (`ModelRunner.execute` on real plans, every
step published into a null sink) and HF `generate()` with a streamer that stamps each step.
torch and transformers are imported only when a side is built, so building the `tandem`
parser stays light."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem_serve.proto.plan_messages import NewRequest, StepPlan
from tandem_serve.proto.request_params import SamplingParams

if TYPE_CHECKING:
    from tandem_serve.bench.step.tp_ranks import RankGroup


@dataclass(frozen=True)
class Placement:
    """Where and how both sides run: float32 on the CPU by default (the parity setting)."""

    device: str = "cpu"
    dtype: str = "float32"
    load_format: str = "auto"  # "dummy": random weights of the config's shape (no checkpoint)


def progress(msg: str) -> None:
    print(f"[bench step] {msg}", file=sys.stderr, flush=True)


def random_prompts(batch: int, prompt_len: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(3, vocab, (batch, prompt_len), dtype=np.int32)


class Ours:
    """One ModelRunner for every batch size; each run starts fresh requests.

    With `tp` > 1 this process is rank 0 of a tensor-parallel group whose other ranks are
    gpu worker processes (`tp_ranks.py`), each with `threads` torch threads."""

    def __init__(self, model: str, max_batch: int, positions: int, k: int, tp: int = 1,
                 threads: int = 0, where: Placement = Placement()) -> None:
        from tandem_serve.gpu_worker.publisher import TokenPublisher
        from tandem_serve.gpu_worker.runner import ModelRunner
        from tandem_serve.proto.config import WorkerConfig

        self.block = 16
        self.per_req = -(-positions // self.block)
        sizes: dict[str, Any] = dict(block_size=self.block,
                                     num_kv_blocks=max_batch * self.per_req,
                                     max_num_seqs=max_batch)
        self.group: RankGroup | None = None
        self.threads = threads
        if tp > 1:
            from tandem_serve.bench.step.tp_ranks import RankGroup

            self.group = RankGroup(model, tp, threads, **sizes)
            self.runner = self.group.runner
        else:
            self.runner = ModelRunner(WorkerConfig(model, device=where.device, dtype=where.dtype,
                                                   load_format=where.load_format, **sizes))
        self.publisher = TokenPublisher(lambda msg: None, self.runner.device)
        self.k = k
        self.plan_id = 0
        self.live: list[int] = []
        self.next_id = 0

    def execute(self, plan_steps: int, **deltas: Any) -> None:
        plan = StepPlan(self.plan_id, plan_steps, **deltas)
        if self.group is not None:
            self.group.forward(plan)
        self.runner.execute(plan, self.publisher)
        self.plan_id += 1

    def samples(self, prompts: np.ndarray, steps: int,
                sampling: list[SamplingParams] | None = None, **deltas: Any) -> list[float]:
        """Milliseconds per step of each timed plan (`sampling`: one per row, default greedy
        and endless; `deltas`: more of the first plan, e.g. guided tables)."""
        import torch

        if self.threads:  # arms of one run may use different thread counts in this process
            torch.set_num_threads(self.threads)
        new = []
        for i, p in enumerate(prompts):
            blocks = list(range(i * self.per_req, (i + 1) * self.per_req))
            params = sampling[i] if sampling else SamplingParams(max_new_tokens=1 << 30)
            new.append(NewRequest(self.next_id + i, p, params, blocks, 0, len(p) - 1))
        self.execute(1, new=new, drop=self.live, **deltas)  # prefill + the first token
        self.live = [n.request_id for n in new]
        self.next_id += len(new)
        out = []
        for start in range(0, steps, self.k):
            k = min(self.k, steps - start)
            t0 = time.perf_counter()
            self.execute(k)
            out.append((time.perf_counter() - t0) / k * 1e3)
        return out

    def close(self) -> None:
        self.publisher.close()
        if self.group is not None:
            self.group.close()


class HF:
    def __init__(self, model: str, where: Placement = Placement()) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer

        dtype = getattr(torch, where.dtype)
        self.device = torch.device(where.device)
        if where.load_format == "dummy":  # random weights made on the device, like ours
            with self.device:
                self.model = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(model), dtype=dtype).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
            self.model.to(self.device)

        class StepStamps(BaseStreamer):
            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value: object) -> None:  # the prompt, then each step's tokens
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        self._stamps = StepStamps

    def samples(self, prompts: np.ndarray, steps: int, window: int) -> list[float]:
        """Milliseconds per step over each `window` consecutive steps after the first token."""
        import torch

        ids = torch.from_numpy(prompts.astype(np.int64)).to(self.device)
        stamps = self._stamps()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                do_sample=False, max_new_tokens=steps + 1,
                                min_new_tokens=steps + 1, pad_token_id=0, streamer=stamps)
        t = stamps.times[1:]  # [0] is the prompt; t[0] the first token (after the prefill)
        ends = list(range(window, steps + 1, window))
        return [(t[e] - t[e - window]) / window * 1e3 for e in ends]
