"""One tensor-parallel rank of the TP parity tests: `python -m tests.gpu_worker.tp_job`.

`test_tensor_parallel.py` starts N of these (gloo over 127.0.0.1).  Each rank loads its
shard of every checkpoint named in the spec and runs the same work; every rank writes what
it got to `OUT/rank{R}.pt`, so the test compares rank 0 with TP=1 and HF, and the other
ranks with rank 0 (their state must stay identical, with nothing crossing but collectives).

The same functions run with `tp=None` in the test process for the TP=1 reference.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from gpu_worker import parallel
from gpu_worker.models.loader import load_model
from gpu_worker.parallel import TensorParallel
from gpu_worker.sync_guard import forbid_host_sync
from proto.config import ServerConfig
from proto.messages import PromptDetail, SamplingParams, TokenBatch
from tests.gpu_worker.model_utils import EOS_ID, PagedDriver, random_prompts
from tests.gpu_worker.runner_driver import NEW_TOKENS, Driver, make_runner, sampled

PREFILL_LENGTHS = [5, 40, 17, 1]
GREEDY_TOKENS = 20
RUNNER_LENGTHS = [1, 33, 70, 7, 20]


def model_outputs(path: str, tp: TensorParallel | None) -> dict[str, Any]:
    """Prefill logits of a few prompts and their greedy continuations (paged driver)."""
    model = load_model(path, torch.float32, torch.device("cpu"),
                       shard=tp.shard if tp is not None else None)
    if tp is not None:
        tp.install(model)
    prompts = random_prompts(PREFILL_LENGTHS, model.config.vocab_size, seed=1)
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=3)
    seqs = [driver.new_seq(p) for p in prompts]
    logits = driver.prefill([(s, len(s.tokens)) for s in seqs])
    fresh = [driver.new_seq(p) for p in prompts]
    greedy = driver.generate(fresh, GREEDY_TOKENS, extra_masked_rows=2)
    return {"logits": logits, "greedy": greedy, "prompts": prompts,
            "kv_heads": model.config.num_kv_heads}


def runner_outputs(path: str, tp: TensorParallel | None, k: int, per_step: bool
                   ) -> dict[str, Any]:
    """A scripted serving run through ModelRunner.execute: greedy, seeded sampled, logprob
    and prompt-logprob requests joining and leaving; the K-step loop under the sync guard."""
    runner = make_runner(path, tp=tp)
    runner.step_guard = forbid_host_sync
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
            "logprobs": [torch.from_numpy(a.copy()) for a in lp],
            "prompt_logprobs": [torch.from_numpy(a.copy()) for a in prompt_lp]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--spec", required=True, help="JSON: {models: {name: path}, runner: path}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    spec = json.loads(args.spec)
    cfg = ServerConfig(model="", device="cpu", tensor_parallel_size=args.size,
                       dist_init_addr=args.addr)
    tp = parallel.start(cfg, args.rank)
    try:
        result: dict[str, Any] = {
            "models": {name: model_outputs(path, tp) for name, path in spec["models"].items()},
            "async_k8": runner_outputs(spec["runner"], tp, 8, True),
            "sync_k1": runner_outputs(spec["runner"], tp, 1, False),
        }
        torch.save(result, f"{args.out}/rank{args.rank}.pt")
    finally:
        tp.close()


if __name__ == "__main__":
    main()
