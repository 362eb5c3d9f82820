"""`tandem bench postproc`: can N postproc workers keep up with the device at batch 64?

Measures, in one run, (a) how many tokens per second one postproc worker turns into
response deltas (detokenize + stop check + token detail), fed batch-64 token batches of
real text, and (b) how many tokens per second the gpu worker decodes at batch 64 on the
same model.  The postproc side keeps up when N × (a) exceeds (b).

`python -m tandem_serve.bench.postproc.detokenizer MODEL_DIR...` times the detokenizer alone.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from tandem_serve.postproc_worker.postprocessor import Postprocessor
from tandem_serve.proto.request_messages import RegisterRequest
from tandem_serve.proto.request_params import OutputOptions
from tandem_serve.proto.token_messages import TokenBatch
from tandem_serve.tokenization.tokenizer import Tokenizer

TEXT = ("Tandem runs the model while the detokenizer works. 東京は日本の首都です。 "
        "مرحبا بالعالم 👩‍👩‍👧‍👦 café naïve résumé\n\tCode: def f(x): return x * 2\n")


def postproc_rate(tok: Tokenizer, batch: int, steps: int, options: OutputOptions,
                  top_n: int = 0) -> float:
    """Tokens per second through one Postprocessor, `batch` requests per step."""
    ids = np.array(tok.encode(TEXT * 40)[1:], dtype=np.int32)
    proc = Postprocessor(tok, 0)
    for rid in range(batch):
        proc.register(RegisterRequest(rid, np.array([1], np.int32), options, 1 << 30))
    rids = np.arange(batch, dtype=np.int64)
    finish = np.zeros(batch, dtype=np.uint8)
    rng = np.random.default_rng(0)
    offsets = rng.integers(0, len(ids) - steps - 1, size=batch)
    batches = []
    for step in range(steps):
        b = TokenBatch(0, step, rids, ids[offsets + step], finish)
        if top_n:
            b.logprobs = rng.standard_normal(batch).astype(np.float32)
            b.ranks = np.ones(batch, dtype=np.int32)
            b.top_ids = rng.integers(0, tok.vocab_size, (batch, top_n)).astype(np.int32)
            b.top_logprobs = np.sort(rng.standard_normal((batch, top_n)), 1)[:, ::-1].astype(
                np.float32)
        batches.append(b)
    t0 = time.perf_counter()
    for b in batches:
        proc.on_batch(b)
    return batch * steps / (time.perf_counter() - t0)


def decode_rate(model_dir: str, batch: int, prompt_len: int, plans: int, steps: int,
                threads: int) -> float:
    """Tokens per second the gpu worker decodes at `batch` (K-step plans, greedy)."""
    import torch

    from tandem_serve.gpu_worker.runner import ModelRunner
    from tandem_serve.proto.config import WorkerConfig
    from tandem_serve.proto.plan_messages import NewRequest, StepPlan
    from tandem_serve.proto.request_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    block = 16
    per_req = -(-(prompt_len + (plans + 1) * steps) // block)
    runner = ModelRunner(WorkerConfig(model_dir, num_kv_blocks=batch * per_req + 1,
                                      block_size=block))

    class Sink:
        def __call__(self, *a: object) -> None: ...
        def end_of_plan(self, plan: object) -> None: ...
        def flush(self) -> None: ...

    sink = Sink()
    new = [NewRequest(i, np.arange(3, 3 + prompt_len, dtype=np.int32) % 31000,
                      SamplingParams(max_new_tokens=1 << 20),
                      list(range(i * per_req, (i + 1) * per_req)), 0, prompt_len - 1)
           for i in range(batch)]
    runner.execute(StepPlan(0, steps, new=new), sink)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for p in range(1, plans + 1):
        runner.execute(StepPlan(p, steps), sink)  # type: ignore[arg-type]
    return batch * steps * plans / (time.perf_counter() - t0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="model folder (default: the tiny model)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="postproc steps to time")
    p.add_argument("--num-postproc-workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads for the decode run")
    p.add_argument("--json", default="", help="write the figures here")


def main(args: argparse.Namespace) -> int:
    model = args.model
    if not model:
        from tandem_serve.harness.tiny_model import ensure_default_model

        model = str(ensure_default_model())
    tok = Tokenizer.from_dir(model)
    cases = {
        "plain": (OutputOptions(), 0),
        "2 stop strings": (OutputOptions(stop_sequences=["never seen", "zzz"]), 0),
        "token detail, top-5": (OutputOptions(token_details=True, logprobs=True, ranks=True,
                                              top_n=5), 5),
    }
    out: dict[str, float] = {}
    for name, (opts, top) in cases.items():
        print(f"[bench] postproc: {name} ...", file=sys.stderr, flush=True)
        out[name] = postproc_rate(tok, args.batch, args.steps, opts, top)
    print("[bench] gpu worker decode at batch", args.batch, "...", file=sys.stderr, flush=True)
    decode = decode_rate(model, args.batch, 128, 6, 8, args.threads)
    n = args.num_postproc_workers
    print(f"\nbatch {args.batch}, {n} postproc workers, model {model}")
    print(f"{'postproc case':<24}{'tok/s per worker':>18}{'x N workers':>14}{'/ decode':>10}")
    for name, rate in out.items():
        print(f"{name:<24}{rate:>18,.0f}{rate * n:>14,.0f}{rate * n / decode:>9.1f}x")
    print(f"{'gpu worker decode':<24}{decode:>18,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "num_postproc_workers": n, "postproc_tok_s": out,
                       "decode_tok_s": decode}, f, indent=2)
    return 0
