"""CUDA-graph decode: the graph plumbing replayed eagerly on CPU, and graphs against eager
on a GPU, both through `Driver` and against HF generate.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.proto.config import WorkerConfig
from tests.gpu_worker.model_utils import random_prompts
from tests.gpu_worker.runner_driver import NEW_TOKENS, Driver, hf_greedy, make_runner, sampled
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.test_kv_fp8 import hf_fp8_greedy


class EagerReplay:
    """Stands in for a CUDA graph on CPU: replay() reruns the captured function."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.out = run()

    def replay(self) -> None:
        self.out.copy_(self.run())


def test_graph_plumbing_padding_and_buckets_on_cpu(llama: str) -> None:
    """Static buffers, padded rows and bucket choice of DecodeGraphs, replayed eagerly."""
    from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs, batch_buckets, width_buckets

    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5] and width_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    runner = make_runner(llama, max_model_len=300, max_num_seqs=8)

    class CpuGraphs(DecodeGraphs):
        def _record(self, run: Any) -> tuple[EagerReplay, torch.Tensor]:
            replay = EagerReplay(run)
            return replay, replay.out

    graphs = CpuGraphs(runner.executor.forward_decode, 8, -(-300 // 16), 16, runner.device)
    runner.graphs = graphs
    prompts = random_prompts([3, 50, 120, 17, 33], 512, seed=62)
    d = Driver(runner, seed=10)
    for rid in range(3):  # batch 3: padded to 4
        d.add(rid, prompts[rid])
    d.run(4)
    d.add(3, prompts[3], sampled(3))
    d.add(4, prompts[4], sampled(4, logprobs=True, top_n=2))
    d.run_until_done([8, 1])
    assert {k[0] for k in graphs._graphs} == {4, 8}
    assert {k[1] for k in graphs._graphs} <= set(width_buckets(19))
    for rid in range(3):
        assert d.reqs[rid].out == hf_greedy(llama, prompts[rid])
    eager = Driver(make_runner(llama, max_model_len=300), seed=10)
    for rid in range(3):
        eager.add(rid, prompts[rid])
    eager.run(4)
    eager.add(3, prompts[3], sampled(3))
    eager.add(4, prompts[4], sampled(4, logprobs=True, top_n=2))
    eager.run_until_done([8, 1])
    assert eager.outputs() == d.outputs()


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_cuda_graph_decode_matches_eager(llama: str, kv: str) -> None:
    prompts = random_prompts([1, 40, 150, 9, 77], 512, seed=61)

    def run(graphs: bool) -> tuple[ModelRunner, dict[int, list[int]]]:
        runner = ModelRunner(WorkerConfig(llama, device="cuda", dtype="float32", block_size=16,
                                          num_kv_blocks=200, max_num_seqs=8, cuda_graphs=graphs,
                                          kv_cache_dtype=kv))
        # Replays and eager steps alike: no host read in the loop.  CUDA's own sync check is
        # process-wide and the publisher thread waits on copy events: dispatch checks only.
        runner.step_guard = functools.partial(forbid_host_sync, cuda_sync_debug=False)
        d = Driver(runner, seed=9)
        for rid in range(3):
            d.add(rid, prompts[rid])
        d.run(4)
        d.add(3, prompts[3], sampled(3, logprobs=True, top_n=2))  # graph logits, eager sampler
        d.add(4, prompts[4], sampled(4, repetition_penalty=1.1))
        d.run_until_done([8, 4, 1])
        return runner, d.outputs()

    graphed, with_graphs = run(True)
    assert graphed.graphs is not None and graphed.graphs.enabled and graphed.graphs._graphs
    _, eager = run(False)
    assert with_graphs == eager
    for rid in range(3):  # fp8: HF reading k/v rounded through e4m3
        want = hf_greedy(llama, prompts[rid]) if kv == "auto" else \
            hf_fp8_greedy(llama, prompts[rid], NEW_TOKENS)
        assert with_graphs[rid] == want


def test_every_decode_graph_is_captured_up_front(llama: str) -> None:
    """capture_all covers every (batch, width) key, so serving captures nothing; all graphs
    write one shared logits buffer (stand-in graphs replayed eagerly on the CPU)."""
    from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs, batch_buckets, width_buckets

    class CpuGraphs(DecodeGraphs):
        def _record(self, run: Any) -> tuple[EagerReplay, torch.Tensor]:
            replay = EagerReplay(run)
            return replay, replay.out

    runner = make_runner(llama, max_model_len=64, max_num_seqs=4)
    graphs = CpuGraphs(runner.executor.forward_decode, 4, -(-64 // 16), 16, runner.device)
    assert graphs.capture_all() == len(batch_buckets(4)) * len(width_buckets(4)) == 9
    assert graphs._logits is not None
    assert {out.data_ptr() for _, out in graphs._graphs.values()} == {graphs._logits.data_ptr()}
    captured = dict(graphs._graphs)
    runner.graphs = graphs
    prompts = random_prompts([5, 20, 9], 512, seed=3)
    d = Driver(runner, seed=4)
    for rid, p in enumerate(prompts):
        d.add(rid, p)
    d.run_until_done([4, 4])
    assert graphs._graphs == captured  # nothing captured while serving
    for rid, p in enumerate(prompts):
        assert d.reqs[rid].out == hf_greedy(llama, p)
