"""One tensor-parallel rank of the TP parity tests: `python -m tests.gpu_worker.tp_job`.

`launch` starts N of these (gloo over 127.0.0.1 on CPU, NCCL with `--device cuda`).  Each
rank loads its shard of every checkpoint named in the spec and runs the same work; every
rank writes what it got to `OUT/rank{R}.pt`, so the tests compare rank 0 with TP=1 and HF,
and the other ranks with rank 0 (their state must stay identical, with nothing crossing but
collectives).

The same functions run with `tp=None` in the test process for the TP=1 reference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tandem_serve.gpu_worker import parallel
from tandem_serve.gpu_worker.models.loader import load_model
from tandem_serve.gpu_worker.parallel import TensorParallel
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.harness.processes import free_port
from tandem_serve.proto.config import ServerConfig, WorkerConfig
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.speculative import parse_speculative
from tandem_serve.proto.token_messages import PromptDetail, TokenBatch
from tests.gpu_worker.guided_utils import guided, table
from tests.gpu_worker.model_utils import EOS_ID, PagedDriver, random_prompts
from tests.gpu_worker.runner_driver import NEW_TOKENS, Driver, sampled
from tests.gpu_worker.served import Served
from tests.gpu_worker.sync_guard import HostSyncError, forbid_host_sync

ROOT = Path(__file__).resolve().parents[2]
PREFILL_LENGTHS = [5, 40, 17, 1]
GREEDY_TOKENS = 20
RUNNER_LENGTHS = [1, 33, 70, 7, 20]
# The adapter run: request -> (adapter or None, guided or not).  Rows 3 and 4 are guided,
# 4 under an adapter; the adapters are one attention-only, one on every linear layer.
LORA_ROWS: dict[int, tuple[str | None, bool]] = {
    0: (None, False), 1: ("attn", False), 2: ("all", False), 3: (None, True), 4: ("all", True),
    5: ("attn", False)}
LORA_SLOTS = {"attn": 1, "all": 2}
LORA_TOKENS = 16
GUIDED_TOKENS = 40
SERVED_LENGTHS = [5, 30, 90, 120]
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def model_outputs(path: str, tp: TensorParallel | None, device: str = "cpu"
                  ) -> dict[str, Any]:
    """Prefill logits of a few prompts and their greedy continuations (paged driver); one
    more decode forward (vocab-parallel embedding, all-reduces, logits gather) runs under
    the host-sync guard, CUDA's sync debug mode included."""
    model = load_model(path, torch.float32, torch.device(device),
                       shard=tp.shard if tp is not None else None)
    if tp is not None:
        tp.install(model)
    prompts = random_prompts(PREFILL_LENGTHS, model.config.vocab_size, seed=1)
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=3)
    seqs = [driver.new_seq(p) for p in prompts]
    logits = driver.prefill([(s, len(s.tokens)) for s in seqs])
    fresh = [driver.new_seq(p) for p in prompts]
    greedy = driver.generate(fresh, GREEDY_TOKENS, extra_masked_rows=2)
    live = [driver.new_seq(p) for p in prompts[:2]]
    driver.append_greedy(live, driver.prefill([(s, len(s.tokens)) for s in live]), 4)
    forward = model.forward

    def guarded(*args: Any) -> torch.Tensor:
        with forbid_host_sync():
            return forward(*args)

    setattr(model, "forward", guarded)  # noqa: B010 - instance override, mypy-clean
    guarded_logits = driver.decode([live[0], None, live[1]])
    return {"logits": logits.cpu(), "greedy": greedy, "prompts": prompts,
            "kv_heads": model.config.num_kv_heads, "guarded": guarded_logits.cpu()}


def runner_outputs(path: str, tp: TensorParallel | None, k: int, per_step: bool,
                   device: str = "cpu") -> dict[str, Any]:
    """A scripted serving run through ModelRunner.execute: greedy, seeded sampled, logprob
    and prompt-logprob requests joining and leaving; the K-step loop under the sync guard.
    On CUDA the decode steps replay CUDA graphs (the collectives captured in them)."""
    runner = ModelRunner(WorkerConfig(path, device=device, dtype="float32", block_size=16,
                                      num_kv_blocks=400), tp)
    # CUDA: the publisher thread waits on copy events meanwhile (sync debug is process-wide).
    runner.step_guard = (forbid_host_sync if device == "cpu"
                         else partial(forbid_host_sync, cuda_sync_debug=False))
    d = Driver(runner, seed=1)
    p = random_prompts(RUNNER_LENGTHS, 512, seed=5)
    detail = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=[EOS_ID], logprobs=True,
                            top_n=2, prompt_logprobs=True)
    d.add(0, p[0])
    d.add(1, p[1])
    d.add(2, p[2], sampled(seed=11))
    d.add(3, p[3], detail)
    d.run(k, per_step)
    d.add(4, p[4], sampled(seed=3, top_k=0, repetition_penalty=1.3))
    i = 0
    while any(not t.finish for t in d.reqs.values()):
        d.run(k, per_step)
        i += 1
        assert i < 100
    lp = [b.logprobs for b in d.messages if isinstance(b, TokenBatch) and b.logprobs is not None]
    prompt_lp = [m.logprobs for m in d.messages if isinstance(m, PromptDetail)]
    return {"out": d.outputs(), "prompts": p, "num_blocks": runner.num_blocks,
            "graphs": runner.graphs is not None and runner.graphs.enabled,
            "logprobs": [torch.from_numpy(a.copy()) for a in lp],
            "prompt_logprobs": [torch.from_numpy(a.copy()) for a in prompt_lp]}


def vision_outputs(spec: dict[str, str], tp: TensorParallel | None, k: int, per_step: bool
                   ) -> dict[int, list[int]]:
    """A VL checkpoint's requests (`spec["cases"]`: a torch.save of (ids, images) pairs) in
    one batch through ModelRunner.execute; each rank holds the whole vision tower."""
    runner = ModelRunner(WorkerConfig(spec["path"], device="cpu", dtype="float32",
                                      block_size=16, num_kv_blocks=400), tp)
    d = Driver(runner, seed=1)
    for i, (ids, images) in enumerate(torch.load(spec["cases"], weights_only=False)):
        d.add(i, ids, SamplingParams(max_new_tokens=12, stop_token_ids=[EOS_ID]),
              images=images)
    while any(not t.finish for t in d.reqs.values()):
        d.run(k, per_step)
    return d.outputs()


def draft_spec(path: str) -> str:
    return json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 3})


def served_outputs(path: str, tp: TensorParallel | None, device: str = "cpu",
                   kv_cache_dtype: str = "auto", speculative: str = "",
                   always: bool = True, attention_backend: str = "auto") -> dict[str, Any]:
    """The real scheduler's plans (K=8, a small per-step budget: prompts prefill in pieces
    inside the decode steps of streams already running) through every rank's runner; each
    rank plans for itself, the same plans from the same counts.  `speculative`: with
    n-gram speculation, every eligible row speculating (`always`) or the rows the measured
    rule picks (each rank times its own forwards: the ranks must still agree)."""
    spec = parse_speculative(speculative)
    runner = ModelRunner(WorkerConfig(path, device=device, dtype="float32", block_size=16,
                                      num_kv_blocks=400, kv_cache_dtype=kv_cache_dtype,
                                      speculative=spec, attention_backend=attention_backend),
                         tp)
    runner.step_guard = (forbid_host_sync if device == "cpu"
                         else partial(forbid_host_sync, cuda_sync_debug=False))
    if runner.speculation is not None:
        runner.speculation.policy.always = always
    served = Served(runner, 8, True, budget=16, params=dict(
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0))
    p = random_prompts(SERVED_LENGTHS, 512, seed=6)
    if spec is not None:  # copy-heavy: every prompt ends by repeating its own start
        p = [x + x[:6] for x in p]
    for rid, prompt in enumerate(p):
        served.add(rid, prompt, sampled(seed=5) if rid == 1 else SamplingParams(
            max_new_tokens=NEW_TOKENS, stop_token_ids=[EOS_ID]), after_plans=rid)
    out = served.run()
    served.close()
    return {"out": out, "prompts": p, "spread": served.spread(),
            "accepted": sum(done.num_accepted_tokens for done in served.done)}


def lora_outputs(spec: dict[str, str], tp: TensorParallel | None, device: str = "cpu"
                 ) -> dict[str, Any]:
    """Adapters (each rank cuts its part of A and B, `gpu_worker.lora.tensor_parallel_split`)
    and a guided row (the same table on every rank) beside base rows, through
    ModelRunner.execute with K varying, the K-step loop under the sync guard.  Unguided rows
    make exactly LORA_TOKENS tokens (min = max: EOS cannot end them early)."""
    path = spec["path"]
    runner = ModelRunner(WorkerConfig(path, device=device, dtype="float32", block_size=16,
                                      num_kv_blocks=200, adapter_cache=spec["cache"],
                                      max_loras=2), tp)
    runner.step_guard = (forbid_host_sync if device == "cpu"
                         else partial(forbid_host_sync, cuda_sync_debug=False))
    d = Driver(runner, seed=2)
    constraint = table(path, spec["regex"])
    d.send_table(constraint)
    for name, slot in LORA_SLOTS.items():
        d.load(slot, name)
    prompts = random_prompts([9, 33, 20, 14, 27, 40], 512, seed=9)
    exact = SamplingParams(max_new_tokens=LORA_TOKENS, min_new_tokens=LORA_TOKENS,
                           stop_token_ids=[EOS_ID])
    for rid, (adapter, is_guided) in LORA_ROWS.items():
        if rid == 5:  # joins the running batch
            d.run(3)
        d.add(rid, prompts[rid], guided(constraint, GUIDED_TOKENS) if is_guided else exact,
              lora_slot=LORA_SLOTS[adapter] if adapter else 0)
    d.run_until_done([8, 1, 5])
    assert all(t.finish for t in d.reqs.values())
    return {"out": d.outputs(), "prompts": prompts,
            "loaded": dict(runner.lora.adapter_of) if runner.lora else {}}


def guard_sees_host_reads(tp: TensorParallel) -> bool:
    """The guard is live in a rank: a collective whose result is read back is caught."""
    try:
        with forbid_host_sync():
            tp.min_int(1)
    except HostSyncError:
        return True
    return False


def launch(spec: dict[str, Any], out: Path, device: str = "cpu", size: int = 2
           ) -> list[dict[str, Any]]:
    """Run the job on `size` ranks (one process each); what each rank wrote."""
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.gpu_worker.tp_job", "--rank",
                               str(r), "--size", str(size), "--addr", addr, "--device", device,
                               "--spec", json.dumps(spec), "--out", str(out)],
                              cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
             for r in range(size)]
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode:
            errors.append(err[-4000:])
    assert not errors, "\n".join(errors)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(size)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--spec", required=True, help="JSON: {models: {name: path}, runner: path, "
                    "lora: {path, cache, regex} (optional)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    spec = json.loads(args.spec)
    dev = args.device
    cfg = ServerConfig(model="", device=dev, tensor_parallel_size=args.size,
                       dist_init_addr=args.addr)
    tp = parallel.start(cfg, args.rank)
    if "vision" in spec:  # a VL checkpoint's run alone (tests/gpu_worker/test_vision.py)
        try:
            torch.save({"vision": {f"k{k}": vision_outputs(spec["vision"], tp, k, k > 1)
                                   for k in (1, 8)}}, f"{args.out}/rank{args.rank}.pt")
            _all_done()
        finally:
            tp.close()
        return
    try:
        if "hybrid" in spec:  # hybrid models' serving runs alone (their own test module)
            runs = (("async_k8", 8, True), ("sync_k1", 1, False))
            torch.save({name: {mode: runner_outputs(path, tp, k, per_step, dev)
                               for mode, k, per_step in runs}
                        for name, path in spec["hybrid"].items()},
                       f"{args.out}/rank{args.rank}.pt")
            _all_done()
            return
        result: dict[str, Any] = {
            "models": {name: model_outputs(path, tp, dev)
                       for name, path in spec["models"].items()},
            "async_k8": runner_outputs(spec["runner"], tp, 8, True, dev),
            "sync_k1": runner_outputs(spec["runner"], tp, 1, False, dev),
            "guard_sees_host_reads": guard_sees_host_reads(tp),
        }
        if spec.get("served", True):
            result.update(served_runs(spec["runner"], tp, dev))
        if "lora" in spec:
            result["lora"] = lora_outputs(spec["lora"], tp, dev)
        torch.save(result, f"{args.out}/rank{args.rank}.pt")
        _all_done()
    finally:
        tp.close()


def _all_done() -> None:
    """Both ranks finished (only on success: a dead peer would hold it to the timeout).
    Without it the rank done first may leave the group while the other's last collective
    still reads from it, and gloo's reader then aborts that process ("terminate called
    without an active exception")."""
    import torch.distributed as dist

    dist.barrier()


def served_runs(path: str, tp: TensorParallel, dev: str) -> dict[str, Any]:
    """The scheduler-driven runs (`served_outputs`) test_tensor_parallel.py compares; the
    quantized and family modules read none of them and leave them out (`"served": false`,
    ~30 s of each module's setup on two busy cores)."""
    return {"served": served_outputs(path, tp, dev),
            "served_fp8": served_outputs(path, tp, dev, "fp8"),
            # Each rank's Triton kernel over its own heads (the interpreter on the CPU).
            "served_triton": served_outputs(path, tp, dev,
                                            attention_backend="triton"),
            "served_spec": served_outputs(path, tp, dev, speculative=SPEC),
            "served_spec_rule": served_outputs(path, tp, dev, speculative=SPEC,
                                               always=False),
            # The target (whole, on every rank) as its own draft: every rank drafts alike.
            "served_draft": served_outputs(path, tp, dev,
                                           speculative=draft_spec(path))}


if __name__ == "__main__":
    main()
