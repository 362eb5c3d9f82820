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
from dataclasses import asdict

from tandem_serve.bench.step.decode import format_table, measure
from tandem_serve.bench.step.runner import Placement, progress
from tandem_serve.bench.step.tp import format_tp_table, measure_tp
from tandem_serve.bench.step.trace import format_trace_table, measure_trace


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
        from tandem_serve.harness.tiny_model import build_tiny_model

        tmp = tempfile.mkdtemp(prefix="tandem-bench-step-")
        progress(f"building the tiny '{args.preset}' model in {tmp}")
        model = str(build_tiny_model(tmp, args.preset))
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
        progress(f"{model}: prompts of {args.prompt_len} tokens, {args.steps} decode steps, "
                 f"K={args.num_scheduler_steps}, {torch.get_num_threads()} threads")
        if args.guided:
            from tandem_serve.bench.step import guided

            return guided.run(model, batches, args)
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
