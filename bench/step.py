"""`tandem bench step`: decode milliseconds per step, ours next to HF `generate()`.

Both sides decode the same batch of random prompts on the same checkpoint, in float32 on
the CPU, over the same context lengths: a prompt of P tokens, a first token, then M timed
decode steps (contexts P+1 .. P+M).

* ours: `ModelRunner.execute` on real plans (prefill + 1 step, then M steps in plans of K),
  every step published through a `TokenPublisher` into a null sink; a plan's wall time over
  its K steps is one sample;
* HF: greedy `generate(max_new_tokens = min_new_tokens = M + 1)` with a streamer that
  timestamps every new token; the time of K consecutive steps over K is one sample (the
  first token, which includes the prefill, starts the clock).

The figure is the median sample over `--repeats` runs, with the two sides alternating: on a
shared machine a noisy neighbour stalls a few samples of either side, not the median.  torch
and transformers are imported only when the benchmark runs, so building the `tandem` parser
stays light.

`--trace` measures what span recording costs instead (the profiler's target: off < 1%, on
< 5% of a decode step).  It alternates runs of ours with the process's tracer off and on, and
times one span alone, off and on; spans per step times the cost of one, over the step time,
is the share a run under `tandem profile` (on) or without it (off) pays.  The direct
traced/untraced ratio is printed too, but on a shared machine its noise is larger than the
effect.

`--tensor-parallel-size N` measures what tensor parallelism costs a step instead: one rank
with T threads next to N ranks (this process and N-1 gpu worker processes, joined by gloo)
with T / N threads each, alternating, on the same cores and the production path (plan
fan-out and collectives included).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem_serve.proto.messages import NewRequest, SamplingParams, StepPlan

if TYPE_CHECKING:
    from tandem_serve.bench.tp_ranks import RankGroup


@dataclass(frozen=True)
class Placement:
    """Where and how both sides run: float32 on the CPU by default (the parity setting)."""

    device: str = "cpu"
    dtype: str = "float32"
    load_format: str = "auto"  # "dummy": random weights of the config's shape (no checkpoint)


@dataclass
class Row:
    batch: int
    ours_ms: float  # median sample
    hf_ms: float | None
    ours_min_ms: float = 0.0  # fastest sample: what a quiet machine gives
    hf_min_ms: float | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.hf_ms is None else self.ours_ms / self.hf_ms


def _progress(msg: str) -> None:
    print(f"[bench step] {msg}", file=sys.stderr, flush=True)


def _prompts(batch: int, prompt_len: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(3, vocab, (batch, prompt_len), dtype=np.int32)


class Ours:
    """One ModelRunner for every batch size; each run starts fresh requests.

    With `tp` > 1 this process is rank 0 of a tensor-parallel group whose other ranks are
    gpu worker processes (`bench.tp_ranks`), each with `threads` torch threads."""

    def __init__(self, model: str, max_batch: int, positions: int, k: int, tp: int = 1,
                 threads: int = 0, where: Placement = Placement()) -> None:
        from tandem_serve.gpu_worker.publisher import TokenPublisher
        from tandem_serve.gpu_worker.runner import ModelRunner

        self.block = 16
        self.per_req = -(-positions // self.block)
        sizes: dict[str, Any] = dict(block_size=self.block,
                                     num_kv_blocks=max_batch * self.per_req,
                                     max_num_seqs=max_batch)
        self.group: RankGroup | None = None
        self.threads = threads
        if tp > 1:
            from tandem_serve.bench.tp_ranks import RankGroup

            self.group = RankGroup(model, tp, threads, **sizes)
            self.runner = self.group.runner
        else:
            self.runner = ModelRunner(model, device=where.device, dtype=where.dtype,
                                      load_format=where.load_format, **sizes)
        self.publisher = TokenPublisher(lambda msg: None, self.runner.device)
        self.k = k
        self.plan_id = 0
        self.live: list[int] = []
        self.next_id = 0

    def _execute(self, plan_steps: int, **deltas: Any) -> None:
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
        self._execute(1, new=new, drop=self.live, **deltas)  # prefill + the first token
        self.live = [n.request_id for n in new]
        self.next_id += len(new)
        out = []
        for start in range(0, steps, self.k):
            k = min(self.k, steps - start)
            t0 = time.perf_counter()
            self._execute(k)
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

        class Stamps(BaseStreamer):
            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value: object) -> None:  # the prompt, then each step's tokens
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        self._stamps = Stamps

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


def measure(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
            repeats: int, with_hf: bool, where: Placement = Placement()) -> list[Row]:
    ours = Ours(model, max(batches), prompt_len + steps + k, k, where=where)
    hf = HF(model, where) if with_hf else None
    vocab = ours.runner.vocab_size
    rows = []
    try:
        for b in batches:
            prompts = _prompts(b, prompt_len, vocab)
            ours.samples(prompts, k)  # warm-up (allocator, oneDNN primitives)
            if hf is not None:
                hf.samples(prompts, 2, 1)
            mine: list[float] = []
            theirs: list[float] = []
            for r in range(repeats):
                mine += ours.samples(prompts, steps)
                if hf is not None:
                    theirs += hf.samples(prompts, steps, k)
                _progress(f"batch {b}: run {r + 1}/{repeats}")
            row = Row(b, float(np.median(mine)), float(np.median(theirs)) if theirs else None,
                      min(mine), min(theirs) if theirs else None)
            rows.append(row)
            _progress(f"batch {b}: ours {row.ours_ms:.2f} ms/step" + (
                "" if row.hf_ms is None or row.ratio is None
                else f", HF {row.hf_ms:.2f} ms/step, ratio {row.ratio:.2f}"))
    finally:
        ours.close()
    return rows


@dataclass
class TPRow:
    batch: int
    tp1_ms: float  # median ms/step, one rank
    tp_ms: float  # median ms/step, `tp` ranks
    tp: int

    @property
    def ratio(self) -> float:
        return self.tp_ms / self.tp1_ms


def measure_tp(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
               repeats: int, tp: int, threads: int) -> list[TPRow]:
    """ms/step with one rank (`threads` torch threads) next to `tp` ranks sharing the same
    cores (threads / tp each), the two alternating run by run."""
    per_rank = max(1, threads // tp)
    one = Ours(model, max(batches), prompt_len + steps + k, k, threads=threads)
    group = Ours(model, max(batches), prompt_len + steps + k, k, tp=tp, threads=per_rank)
    rows = []
    try:
        for b in batches:
            prompts = _prompts(b, prompt_len, one.runner.vocab_size)
            one.samples(prompts, k)  # warm-up
            group.samples(prompts, k)
            samples: dict[int, list[float]] = {1: [], tp: []}
            for r in range(repeats):
                for arm in ((one, group) if r % 2 == 0 else (group, one)):
                    samples[1 if arm is one else tp] += arm.samples(prompts, steps)
                _progress(f"batch {b}: run {r + 1}/{repeats}")
            row = TPRow(b, float(np.median(samples[1])), float(np.median(samples[tp])), tp)
            rows.append(row)
            _progress(f"batch {b}: TP=1 {row.tp1_ms:.2f} ms/step, TP={tp} {row.tp_ms:.2f}, "
                      f"ratio {row.ratio:.2f}")
    finally:
        one.close()
        group.close()
    return rows


def format_tp_table(rows: list[TPRow], threads: int) -> str:
    tp = rows[0].tp if rows else 2
    lines = [f"| batch | TP=1 ms/step ({threads} threads) | TP={tp} ms/step "
             f"({max(1, threads // tp)} thread(s) per rank) | TP={tp} / TP=1 |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.tp1_ms:.2f} | {r.tp_ms:.2f} | {r.ratio:.2f} |")
    return "\n".join(lines)


@dataclass
class TraceRow:
    batch: int
    off_ms: float  # median ms/step, tracer off
    on_ms: float  # median ms/step, tracer on
    spans_per_step: float
    span_off_ns: float  # one span, tracer off
    span_on_ns: float

    @property
    def ratio(self) -> float:
        return self.on_ms / self.off_ms

    @property
    def off_pct(self) -> float:
        return 100 * self.spans_per_step * self.span_off_ns / (self.off_ms * 1e6)

    @property
    def on_pct(self) -> float:
        return 100 * self.spans_per_step * self.span_on_ns / (self.off_ms * 1e6)


def span_cost_ns(enabled: bool, n: int = 200_000) -> float:
    """Nanoseconds one `with tracer.span(...)` costs, the bare loop taken off."""
    from tandem_serve.ipc.tracing import Tracer

    tracer = Tracer("bench")
    if enabled:
        tracer.start()
    best = float("inf")
    for _ in range(5):  # the quietest of a few rounds: a neighbour's time slice is not ours
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pass
        t1 = time.perf_counter_ns()
        for _ in range(n):
            with tracer.span("forward", 1, 2):
                pass
        t2 = time.perf_counter_ns()
        best = min(best, ((t2 - t1) - (t1 - t0)) / n)
        tracer.spans.clear()
    return best


def _spans_per_step(spans: list[list[Any]]) -> float:
    """Spans of the decode plans per decode step, plus the worker loop's one per plan."""
    by_plan: dict[int, list[str]] = {}
    for s in spans:
        by_plan.setdefault(s[3], []).append(s[0])
    decode = [names for names in by_plan.values() if "prefill" not in names]
    steps = sum(names.count("forward") for names in decode)
    return (sum(len(names) + 1 for names in decode)) / max(steps, 1)  # +1: "idle"


def measure_trace(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
                  repeats: int) -> list[TraceRow]:
    from tandem_serve.ipc.tracing import TRACER

    ours = Ours(model, max(batches), prompt_len + steps + k, k)
    costs = span_cost_ns(False), span_cost_ns(True)
    rows = []
    try:
        for b in batches:
            prompts = _prompts(b, prompt_len, ours.runner.vocab_size)
            ours.samples(prompts, k)  # warm-up
            samples: dict[bool, list[float]] = {False: [], True: []}
            per_step: list[float] = []
            for r in range(repeats):
                for traced in ((False, True) if r % 2 == 0 else (True, False)):
                    if traced:
                        TRACER.start()
                    samples[traced] += ours.samples(prompts, steps)
                    if traced:
                        per_step.append(_spans_per_step(TRACER.stop()["spans"]))
                _progress(f"batch {b}: run {r + 1}/{repeats}")
            row = TraceRow(b, float(np.median(samples[False])), float(np.median(samples[True])),
                           float(np.mean(per_step)), *costs)
            rows.append(row)
            _progress(f"batch {b}: off {row.off_ms:.2f} ms/step, on {row.on_ms:.2f}, "
                      f"span cost off {row.off_pct:.4f}%, on {row.on_pct:.3f}% of a step")
    finally:
        ours.close()
    return rows


def format_trace_table(rows: list[TraceRow]) -> str:
    lines = ["| batch | ms/step off | ms/step on | on / off | spans/step | span ns off | "
             "span ns on | off % of step | on % of step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.off_ms:.2f} | {r.on_ms:.2f} | {r.ratio:.3f} | "
                     f"{r.spans_per_step:.2f} | {r.span_off_ns:.0f} | {r.span_on_ns:.0f} | "
                     f"{r.off_pct:.4f} | {r.on_pct:.3f} |")
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    lines = ["| batch | ours ms/step | HF ms/step | ours / HF |", "|---:|---:|---:|---:|"]
    for r in rows:
        hf = "-" if r.hf_ms is None else f"{r.hf_ms:.2f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"| {r.batch} | {r.ours_ms:.2f} | {hf} | {ratio} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="",
                   help="HF model folder (default: the tiny default model, built in a temp dir)")
    p.add_argument("--preset", default="default", help="tiny model preset when --model is unset")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--num-scheduler-steps", type=int, default=8, help="K: steps per plan")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and batch size")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the config's shape on both sides")
    p.add_argument("--json", default="", help="also write the figures to this file")
    p.add_argument("--trace", action="store_true",
                   help="measure span recording instead: tracer off vs on, and one span's cost")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1: ms/step of N tensor-parallel ranks (gloo, real gpu worker "
                        "processes) next to one rank, on the same cores")
    p.add_argument("--guided", action="store_true",
                   help="measure guided decoding instead: no guided rows vs --guided-share of "
                        "them per kind (regex, choice, JSON schema tables; a grammar)")
    p.add_argument("--guided-share", type=float, default=0.5,
                   help="with --guided: the share of the batch's rows that are guided")


def main(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    model = args.model
    if not model:
        from tandem_serve.gpu_worker.tiny_model import build_tiny_model

        tmp = tempfile.mkdtemp(prefix="tandem-bench-step-")
        _progress(f"building the tiny '{args.preset}' model in {tmp}")
        model = str(build_tiny_model(tmp, args.preset))
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
        _progress(f"{model}: prompts of {args.prompt_len} tokens, {args.steps} decode steps, "
                  f"K={args.num_scheduler_steps}, {torch.get_num_threads()} threads")
        if args.guided:
            from tandem_serve.bench import guided_step

            return guided_step.run(model, batches, args)
        if args.trace:
            trace_rows = measure_trace(model, batches, args.prompt_len, args.steps,
                                       args.num_scheduler_steps, args.repeats)
        elif args.tensor_parallel_size > 1:
            threads = args.threads or torch.get_num_threads()
            tp_rows = measure_tp(model, batches, args.prompt_len, args.steps,
                                 args.num_scheduler_steps, args.repeats,
                                 args.tensor_parallel_size, threads)
        else:
            rows = measure(model, batches, args.prompt_len, args.steps,
                           args.num_scheduler_steps, args.repeats, not args.no_hf,
                           Placement(args.device, args.dtype, args.load_format))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.trace:
        print(format_trace_table(trace_rows))
        figures = [dict(asdict(r), ratio=r.ratio, off_pct=r.off_pct, on_pct=r.on_pct)
                   for r in trace_rows]
    elif args.tensor_parallel_size > 1:
        print(format_tp_table(tp_rows, threads))
        figures = [dict(asdict(r), ratio=r.ratio) for r in tp_rows]
    else:
        print(format_table(rows))
        figures = [dict(asdict(r), ratio=r.ratio) for r in rows]
    if args.json:
        report = {"model": args.model or f"tiny-{args.preset}", "threads": torch.get_num_threads(),
                  "device": args.device, "dtype": args.dtype, "load_format": args.load_format,
                  "prompt_len": args.prompt_len, "decode_steps": args.steps,
                  "num_scheduler_steps": args.num_scheduler_steps, "rows": figures}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
