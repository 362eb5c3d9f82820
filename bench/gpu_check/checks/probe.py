"""The probe stage of `scripts/gpu-check`: decode ms/step of the Llama-3-8B shape (random
weights made on the device, Llama 3's 128,256-token vocabulary) per attention backend,
batch and context, next to the step's memory-bandwidth bound (`bound.py`), with attention's
share of the step.

Each arm is a process of its own (`python -m tandem_serve.bench.gpu_check.checks.probe`): one
`ModelRunner` (`--attention-backend NAME`, CUDA graphs on, as a server runs it) and, for
every context and batch, fresh requests whose prompts are already in the KV cache but for
their last token (`num_cached_tokens`; the cache holds whatever it was allocated with, which
costs a read as much as real keys do), a plan that decodes that token, a warm-up plan of K
steps (the batch's graph is captured there), then timed plans of K steps, each timed with
CUDA events around `ModelRunner.execute` (a plan ends with its one host read, so the
events span the device's whole plan) over K.  A process per arm frees the device between
arms, and a timed-out arm leaves the cells it wrote.

Attention's share: one more arm runs with every layer's `attend` returning zeros (no KV
write, no attention; the rest of the step unchanged), so share = 1 - that arm's ms/step /
the backend's at the same batch and context.

Backends: the plan's list, else every name `gpu_worker.attention.registry` says serves this
device at the server's block size (where the tree has no such registry: the worker's own
choice, `auto`).  On the CPU the same code runs the tiny model with tiny sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem_serve.bench.gpu_check.bound import ideal_step_ms, read_bandwidth_gbs, step_read_bytes
from tandem_serve.bench.gpu_check.models import decode_weight_bytes, kv_bytes_per_token, probe_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget, say
from tandem_serve.bench.gpu_check.supervise import run_tree

NO_ATTENTION = "no attention"
BLOCK = 16  # the server's default block size
K = 8  # steps per plan, the server's default

# ----------------------------------------------------------------------- the child process


class StepProbe:
    """Cells of ms/step on one runner: fresh requests per cell (see the module doc)."""

    def __init__(self, runner: Any, publisher: Any, per_req: int, k: int = K,
                 clock: Callable[[Callable[[], object]], float] | None = None) -> None:
        self.runner = runner
        self.publisher = publisher
        self.per_req = per_req
        self.k = k
        self.clock = clock or wall_ms
        self.plan_id = 0
        self.next_id = 0
        self.live: list[int] = []

    def execute(self, num_steps: int, **deltas: Any) -> None:
        from tandem_serve.proto.plan_messages import StepPlan

        self.runner.execute(StepPlan(self.plan_id, num_steps, **deltas), self.publisher)
        self.plan_id += 1

    def cell(self, batch: int, context: int, steps: int) -> dict[str, Any]:
        """ms/step of `batch` rows attending to ~`context` tokens: median and fastest plan,
        and the mean context the timed steps attended to."""
        from tandem_serve.proto.plan_messages import NewRequest
        from tandem_serve.proto.request_params import SamplingParams

        rng = np.random.default_rng(batch * 100003 + context)
        vocab = self.runner.vocab_size
        new = [NewRequest(self.next_id + i, rng.integers(3, vocab, context, dtype=np.int32),
                          SamplingParams(max_new_tokens=1 << 30),
                          list(range(i * self.per_req, (i + 1) * self.per_req)),
                          context - 1, 0) for i in range(batch)]
        self.execute(1, new=new, drop=self.live)  # no prefill: decodes the prompt's last token
        self.live = [n.request_id for n in new]
        self.next_id += batch
        self.execute(self.k)  # warm-up: the batch's graph, first-use work
        plans = max(1, steps // self.k)
        ms = [self.clock(lambda: self.execute(self.k)) / self.k for _ in range(plans)]
        # The first step attends to the prompt's `context` tokens; timed step j (after the
        # warm-up's k) to context + 1 + k + j.
        mean_context = context + 1 + self.k + (plans * self.k - 1) / 2
        return {"batch": batch, "context": context, "ms": statistics.median(ms),
                "min_ms": min(ms), "mean_context": mean_context, "steps": plans * self.k}


def wall_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def cuda_ms(fn: Callable[[], object]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _no_attention(self: object, q: Any, *args: Any, **kwargs: Any) -> Any:
    return q.new_zeros(q.shape)


def stub_attention() -> None:
    """Every decoder layer's `attend` (KV write and attention) returns zeros of q's shape: a
    step without attention whose activations stay those of a model (q itself would feed
    the rotated queries on, which grow, and slow a CPU down with denormals)."""
    from tandem_serve.gpu_worker.models import decoder

    layers = [c for c in vars(decoder).values() if isinstance(c, type) and "attend" in vars(c)]
    if not layers:
        raise SystemExit("probe: gpu_worker.models.decoder has no layer with an `attend` "
                         "method; attention's share cannot be measured")
    for cls in layers:
        setattr(cls, "attend", _no_attention)  # noqa: B010 - a class found at run time


def worker_config(args: argparse.Namespace, max_batch: int, per_req: int) -> Any:
    from tandem_serve.proto.config import WorkerConfig

    return WorkerConfig(args.model, device=args.device, dtype=args.dtype, block_size=BLOCK,
                        num_kv_blocks=max_batch * per_req, max_num_seqs=max_batch,
                        max_model_len=per_req * BLOCK, load_format=args.load_format,
                        attention_backend=args.attention_backend)


def child(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_serve.bench.gpu_check.checks.probe")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-attention", action="store_true", help="every layer's attend: q")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", required=True, help="written after every cell")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    from tandem_serve.gpu_worker.models.loader import weight_bytes
    from tandem_serve.gpu_worker.publisher import TokenPublisher
    from tandem_serve.gpu_worker.runner import ModelRunner

    if args.device == "cpu":  # one thread, as the pinned gpu worker of a 2-core host has:
        import torch  # a thread that waits for a busy core would stall every step

        torch.set_num_threads(1)
    out: dict[str, Any] = {"read_gbs": read_bandwidth_gbs(args.device), "cells": []}
    if args.no_attention:
        stub_attention()
    per_req = -(-(max(contexts) + 1 + K * (2 + args.steps // K)) // BLOCK)
    t0 = time.monotonic()
    runner = ModelRunner(worker_config(args, max(batches), per_req))
    out.update(load_s=time.monotonic() - t0, weight_bytes=weight_bytes(runner.model))
    publisher = TokenPublisher(lambda msg: None, runner.device)
    probe = StepProbe(runner, publisher, per_req,
                      clock=cuda_ms if runner.device.type == "cuda" else wall_ms)
    try:
        probe.cell(max(batches), min(contexts), K)  # first-use work of the process, not timed
        for context in contexts:
            for batch in batches:
                out["cells"].append(probe.cell(batch, context, args.steps))
                _write(args.json, out)
                c = out["cells"][-1]
                print(f"[probe] batch {batch}, context {context}: {c['ms']:.3f} ms/step",
                      file=sys.stderr, flush=True)
    finally:
        publisher.close()
        _write(args.json, out)
    return 0


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------------- the stage (parent)


def device_backends(device: str, dtype: str) -> tuple[list[str], str]:
    """The attention backends that serve `device` and `dtype` at the server's block size
    (`gpu_worker.attention.registry`; a backend `auto` passes over there, such as Triton's
    interpreter on the CPU, is left out), and a note when none does (then `auto`)."""
    import torch

    from tandem_serve.gpu_worker.attention import registry

    dev, dt = torch.device(device), getattr(torch, dtype)
    names = [name for name, cls in registry.BACKENDS.items()
             if cls.auto_skips(dev, dt, dt, BLOCK) is None
             or (dev.type == "cuda" and cls.supports(dev, dt, dt, BLOCK) is None)]
    return (names, "") if names else (["auto"], "no backend says it serves here")


ArmRunner = Callable[[str, list[str], float, str], dict[str, Any]]


def run_arm(arm: str, args: list[str], timeout: float, path: str) -> dict[str, Any]:
    """One arm's process; its figures (the cells it finished, even when it failed or ran out
    of time, with `error` saying so)."""
    cmd = [sys.executable, "-m", "tandem_serve.bench.gpu_check.checks.probe", *args, "--json", path]
    error = ""
    try:
        proc = run_tree(cmd, timeout)
        if proc.returncode:
            last = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            error = f"exit {proc.returncode}: {last[0][:300]}"
    except Exception as exc:  # noqa: BLE001 - subprocess.TimeoutExpired, mostly
        error = f"timed out after {timeout:.0f} s" if "Timeout" in type(exc).__name__ \
            else f"{type(exc).__name__}: {exc}"
    data: dict[str, Any] = {"cells": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    if error:
        data["error"] = error
    return data


def stage_probe(plan: Plan, out: str, budget: Budget,
                runner: ArmRunner = run_arm) -> tuple[dict[str, Any], str]:
    model, load_format = probe_model(plan, out)
    if plan.probe_backends:
        backends, note = list(plan.probe_backends), ""
    else:
        backends, note = device_backends(plan.device, plan.dtype)
    common = ["--model", model, "--device", plan.device, "--dtype", plan.dtype,
              "--load-format", load_format,
              "--batches", ",".join(map(str, plan.probe_batches)),
              "--contexts", ",".join(map(str, plan.probe_contexts)),
              "--steps", str(plan.probe_steps)]
    # The no-attention arm first: every backend's share needs it.
    arms = {NO_ATTENTION: [*common, "--no-attention"],
            **{b: [*common, "--attention-backend", b] for b in backends}}
    results: dict[str, dict[str, Any]] = {}
    for i, (arm, args) in enumerate(arms.items()):
        timeout = max(budget.left / (len(arms) - i) - 2, 5.0)
        say(f"probe: {arm} ({timeout:.0f} s at most)")
        path = os.path.join(out, f"probe-{arm.replace(' ', '-')}.json")
        results[arm] = runner(arm, args, timeout, path)
    fig = probe_figures(results, decode_weight_bytes(model, plan.dtype),
                        kv_bytes_per_token(model, plan.dtype))
    fig.update(backends=backends, backends_note=note, model=os.path.basename(model))
    if not any(r["backend"] != NO_ATTENTION for r in fig["rows"]):
        raise RuntimeError("probe: no backend measured a cell: " + "; ".join(
            f"{a}: {r.get('error', '?')}" for a, r in results.items()))
    return fig, probe_text(fig)


def probe_figures(results: dict[str, dict[str, Any]], weight_bytes: int,
                  kv_per_token: int) -> dict[str, Any]:
    """Rows per (arm, context, batch): ms/step (median and fastest plan), the bound from the
    bytes the step reads and the fastest read bandwidth any arm measured, and, from the
    fastest plans (as the bandwidth is from the fastest pass: on a shared host a neighbour
    slows some plans, not the fastest), the ratio to the bound and attention's share."""
    read_gbs = max((r["read_gbs"] for r in results.values() if r.get("read_gbs")), default=0.0)
    bare = {(c["batch"], c["context"]): c["min_ms"]
            for c in results.get(NO_ATTENTION, {}).get("cells", [])}
    rows = []
    for arm, r in results.items():
        for c in r.get("cells", []):
            ideal = (ideal_step_ms(step_read_bytes(weight_bytes, kv_per_token, c["batch"],
                                                   c["mean_context"]), read_gbs)
                     if read_gbs else None)
            without = bare.get((c["batch"], c["context"]))
            share = (1 - without / c["min_ms"]) if without and arm != NO_ATTENTION else None
            rows.append({"backend": arm, "batch": c["batch"], "context": c["context"],
                         "ms": c["ms"], "min_ms": c["min_ms"], "ideal_ms": ideal,
                         "over_ideal": c["min_ms"] / ideal if ideal else None,
                         "attention_share": share})
    return {"read_gbs": read_gbs, "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_per_token, "rows": rows,
            "errors": {a: r["error"] for a, r in results.items() if r.get("error")},
            "load_s": {a: r.get("load_s") for a, r in results.items()}}


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def probe_text(fig: dict[str, Any]) -> str:
    head = (f"Read bandwidth (a reduction over a large tensor; the fastest of the arms' "
            f"probes): {fig['read_gbs']:.0f} GB/s. A step reads the weights "
            f"({fig['weight_bytes'] / 2**30:.2f} GiB) and {fig['kv_bytes_per_token'] / 1024:g} "
            "KiB of K and V per token each row attends to; bound = those bytes / the read "
            "bandwidth. Steps timed with CUDA events on a GPU, the wall clock on a CPU: the "
            "median and the fastest of the timed plans; the share and the ratio are of the "
            "fastest (as the bandwidth is the fastest pass). Attention's share = 1 - ms/step "
            "with every layer's attention returning zeros / ms/step.")
    if fig.get("backends_note"):
        head += f" Backends: {', '.join(fig['backends'])} ({fig['backends_note']})."
    lines = ["| backend | batch | context | ms/step | fastest | attention share | bound ms | "
             "fastest / bound |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in fig["rows"]:
        share = r["attention_share"]
        lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | "
                     f"{r['min_ms']:.3f} | {_f(share, '.0%')} | {_f(r['ideal_ms'], '.3f')} | "
                     f"{_f(r['over_ideal'], '.2f')}{'×' if r['over_ideal'] else ''} |")
    errors = [f"- {a}: {e}" for a, e in fig["errors"].items()]
    return "\n".join([head, "", *lines, *(["", "Arms that did not finish:", *errors]
                                          if errors else [])])


if __name__ == "__main__":
    sys.exit(child())
