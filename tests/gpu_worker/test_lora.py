"""LoRA in the runner: mixed batches of adapters (and none) against PEFT's own generate().

`Driver` plays the scheduler, loading adapters into slots through plan deltas; PEFT's
`PeftModel.from_pretrained` on the same base, float32, is the judge of every stream.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem_serve.proto.request_params import FinishReason
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import Driver, checkpoint, make_runner
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.lora_utils import ADAPTERS, make_adapters, peft_greedy

NEW = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return checkpoint(tmp_path_factory.mktemp("lora-ckpt"), "llama-gqa")


@pytest.fixture(scope="module")
def cache(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    return make_adapters(model, root)


PROMPTS = random_prompts([5, 40, 23, 70, 9, 31], 512, seed=77)
# request -> adapter (None: the base model)
MIX: dict[int, str | None] = {0: None, 1: "attn", 2: "all", 3: "mlp", 4: "attn", 5: None}


@pytest.fixture(scope="module")
def expected(model: str, cache: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in (None, *ADAPTERS):
        rids = [r for r, a in MIX.items() if a == name]
        refs = peft_greedy(model, cache / name if name else None, [PROMPTS[r] for r in rids],
                           NEW, NEW)
        out.update(zip(rids, refs, strict=True))
    return out


def lora_runner(model: str, cache: Path, **kw: Any) -> Any:
    return make_runner(model, adapter_cache=str(cache), max_loras=kw.pop("max_loras", 4), **kw)


def run_mix(d: Driver) -> None:
    """Adapters joining and leaving a running batch, K varying, prefill beside decode."""
    slots = {"attn": 1, "all": 3, "mlp": 2}
    d.load(1, "attn")
    d.load(3, "all")
    for rid in (0, 1, 2):
        d.add(rid, PROMPTS[rid], lora_slot=slots.get(MIX[rid] or "", 0))
    d.run(1)
    d.load(2, "mlp")
    d.add(3, PROMPTS[3], lora_slot=2)
    d.run(4)
    d.add(4, PROMPTS[4], lora_slot=1)
    d.add(5, PROMPTS[5])
    d.run_until_done([8, 1, 3])


def sampling(n: int = NEW) -> Any:
    from tandem_serve.proto.request_params import SamplingParams

    return SamplingParams(max_new_tokens=n, min_new_tokens=n, stop_token_ids=[EOS_ID])


def test_mixed_adapters_in_one_batch_equal_peft(model: str, cache: Path,
                                                expected: dict[int, list[int]]) -> None:
    d = Driver(lora_runner(model, cache), seed=4)
    d.add = functools.partial(d.add, sampling=sampling())  # type: ignore[method-assign]
    run_mix(d)
    for rid, adapter in MIX.items():
        assert d.reqs[rid].out == expected[rid], f"request {rid} ({adapter or 'base'})"
    # The adapters change the output (else parity would prove nothing).
    base = peft_greedy(model, None, [PROMPTS[r] for r in (1, 2, 3)], NEW, NEW)
    assert all(expected[r] != b for r, b in zip((1, 2, 3), base, strict=True))


def test_no_host_sync_in_the_k_step_loop_with_adapters(model: str, cache: Path,
                                                       expected: dict[int, list[int]]) -> None:
    runner = lora_runner(model, cache)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=5)
    d.add = functools.partial(d.add, sampling=sampling())  # type: ignore[method-assign]
    run_mix(d)
    assert d.outputs() == expected


def test_a_slot_reloaded_with_another_adapter_forgets_the_first(model: str, cache: Path,
                                                                expected: dict[int, list[int]]
                                                                ) -> None:
    d = Driver(lora_runner(model, cache, max_loras=1), seed=6)
    d.load(1, "all")
    d.add(2, PROMPTS[2], sampling(), lora_slot=1)
    d.run_until_done([8])
    d.load(1, "mlp")  # "all" adapts every module: any leftover would show
    d.add(3, PROMPTS[3], sampling(), lora_slot=1)
    d.run_until_done([8])
    assert d.reqs[2].out == expected[2] and d.reqs[3].out == expected[3]
    assert d.runner.lora.adapter_of == {1: "mlp"}


def test_a_failed_load_fails_its_requests_and_nobody_else(model: str, cache: Path,
                                                          expected: dict[int, list[int]]
                                                          ) -> None:
    broken = cache / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((cache / "attn" / "adapter_config.json")
                                                .read_text())
    data = (cache / "attn" / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    runner = lora_runner(model, cache)
    d = Driver(runner, seed=7)
    d.load(1, "attn")
    d.add(1, PROMPTS[1], sampling(), lora_slot=1)
    d.run(4)
    d.load(2, "broken")
    d.add(3, PROMPTS[3], sampling(), lora_slot=2)
    d.add(0, PROMPTS[0], sampling())
    done = d.run(4)
    failures = runner.take_adapter_failures()
    assert [(f.adapter_id, f.slot, f.request_ids) for f in failures] == [("broken", 2, [3])]
    assert "truncated" in failures[0].message
    assert dict(zip(done.finished_ids.tolist(), done.finish_reasons.tolist(), strict=True)
                ) == {3: FinishReason.ERROR}
    assert d.reqs[3].out == []
    d.run_until_done([8])
    assert d.reqs[1].out == expected[1] and d.reqs[0].out == expected[0]


def test_graph_path_applies_every_slot(model: str, cache: Path,
                                       expected: dict[int, list[int]]) -> None:
    """The CUDA-graph plumbing (static slot buffer, all slots and modules), replayed on CPU."""
    from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs

    class CpuGraphs(DecodeGraphs):
        def _record(self, run: Any) -> tuple[Any, torch.Tensor]:
            replay = _EagerReplay(run)
            return replay, replay.out

    runner = lora_runner(model, cache, max_num_seqs=8)
    runner.graphs = CpuGraphs(runner.executor.forward_decode, 8, -(-1024 // 16), 16, runner.device,
                              runner.lora.full_context)
    d = Driver(runner, seed=8)
    d.add = functools.partial(d.add, sampling=sampling())  # type: ignore[method-assign]
    run_mix(d)
    assert d.outputs() == expected
    assert {k[2] for k in runner.graphs._graphs} == {True}


class _EagerReplay:
    def __init__(self, run: Any) -> None:
        self.run = run
        self.out = run()

    def replay(self) -> None:
        self.out.copy_(self.run())


def test_segment_and_masked_forms_add_the_same_deltas(model: str, cache: Path) -> None:
    """Eager segments (rows grouped by slot, each at its own rank), the masked fallback for
    ungrouped rows, and the graphs' form over every slot agree; rows without an adapter get
    exactly nothing added."""
    runner = lora_runner(model, cache)
    lora = runner.lora
    for slot, name in ((1, "attn"), (2, "all"), (4, "mlp")):
        lora.load(slot, name)
    slots = [0, 0, 1, 1, 1, 2, 4, 4, 0]
    gen = torch.Generator().manual_seed(3)
    grouped = lora.context(slots)
    shuffled = [4, 1, 0, 2, 0, 1, 4, 1, 0]
    assert grouped.segments is not None and lora.context(shuffled).segments is None
    assert lora.context([0, 0]) is None
    # Two ranges of one adapter (guided rows grouped first) are still segments.
    assert lora.context([1, 2, 0, 1, 2]).segments is not None
    for layer in range(lora.shapes.num_layers):
        for fused in ("qkv", "o", "gate_up", "down"):
            x = torch.randn(len(slots), lora.a[layer][fused].shape[1], generator=gen)
            base = torch.randn(len(slots), lora.bt[layer][fused].shape[1], generator=gen)
            got = grouped.add(layer, fused, x, base.clone())
            full = lora.full_context(torch.tensor(slots)).add(layer, fused, x, base.clone())
            torch.testing.assert_close(got, full)
            rows_of = {s: [i for i, t in enumerate(slots) if t == s] for s in set(slots)}
            order = [rows_of[s].pop(0) for s in shuffled]  # shuffled[i] == slots[order[i]]
            masked = lora.context(shuffled).add(layer, fused, x[order], base[order].clone())
            torch.testing.assert_close(masked, got[order])
            assert torch.equal(got[[0, 1, 8]], base[[0, 1, 8]])
            assert fused in ("qkv", "o") or torch.equal(got[2:5], base[2:5])  # attn only


@pytest.mark.gpu
def test_cuda_graphs_with_adapters_match_eager_and_peft(model: str, cache: Path,
                                                        expected: dict[int, list[int]]) -> None:
    from tandem_serve.gpu_worker.runner import ModelRunner
    from tandem_serve.proto.config import WorkerConfig

    def run(graphs: bool) -> tuple[Any, dict[int, list[int]]]:
        runner = ModelRunner(WorkerConfig(model, device="cuda", dtype="float32", block_size=16,
                                          num_kv_blocks=400, max_num_seqs=8, cuda_graphs=graphs,
                                          adapter_cache=str(cache), max_loras=4))
        runner.step_guard = functools.partial(forbid_host_sync, cuda_sync_debug=False)
        d = Driver(runner, seed=9)
        d.add = functools.partial(d.add, sampling=sampling())  # type: ignore[method-assign]
        run_mix(d)
        return runner, d.outputs()

    graphed, with_graphs = run(True)
    assert graphed.graphs is not None and graphed.graphs.enabled
    assert any(key[2] for key in graphed.graphs._graphs), "no LoRA graph was captured"
    assert with_graphs == run(False)[1]
    assert with_graphs == expected


def test_seeded_sampling_and_logprobs_under_an_adapter_ignore_the_batch(model: str,
                                                                       cache: Path) -> None:
    """A seeded sampled request on an adapter draws the same tokens alone and in a mixed
    batch, and its logprobs come from its adapter's distribution (rank 1 when greedy)."""
    from tandem_serve.proto.request_params import SamplingParams
    from tandem_serve.proto.token_messages import TokenBatch
    from tests.gpu_worker.runner_driver import sampled

    def run(mixed: bool) -> tuple[list[int], list[TokenBatch]]:
        d = Driver(lora_runner(model, cache), seed=12)
        d.load(1, "all")
        d.load(2, "mlp")
        d.add(7, PROMPTS[2], sampled(5, max_new_tokens=NEW), lora_slot=1)
        d.add(8, PROMPTS[3], SamplingParams(max_new_tokens=NEW, logprobs=True, top_n=2),
              lora_slot=1)
        if mixed:
            d.add(0, PROMPTS[0], sampling())
            d.add(3, PROMPTS[3], sampled(9, max_new_tokens=NEW), lora_slot=2)
        d.run_until_done([8, 3])
        return d.reqs[7].out, [m for m in d.messages if isinstance(m, TokenBatch)]

    alone, _ = run(False)
    together, batches = run(True)
    assert alone == together and len(alone) > 0
    rows = [(b.ranks[list(b.request_ids).index(8)], b.logprobs[list(b.request_ids).index(8)])
            for b in batches if 8 in b.request_ids and b.token_ids[
                list(b.request_ids).index(8)] >= 0]
    assert rows and all(rank == 1 and lp <= 0 for rank, lp in rows)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_verify_rows_apply_their_adapters(model: str, cache: Path,
                                                      expected: dict[int, list[int]],
                                                      method: str) -> None:
    # Each request's 1 + k verify rows run under its adapter (drafts from 1-grams: some
    # are proposed on these random prompts, and verified under the adapter; or from the
    # base model as the draft, which proposes without the adapters).
    import json

    from tandem_serve.proto.speculative import parse_speculative

    spec = parse_speculative(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 2}' if method == "ngram" else
        json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": 3}))
    runner = lora_runner(model, cache, speculative=spec)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=6)
    d.add = functools.partial(d.add, sampling=sampling())  # type: ignore[method-assign]
    run_mix(d)
    assert d.outputs() == expected
    assert sum(done.num_drafts for done in d.done) > 0
