"""OpenAI's logit_bias on the device: the sampler against the dense formula, the runner
against HF generate() with `SequenceBiasLogitsProcessor` across plans and a preemption, and
speculation (the verify path biases every draft position as a plain step would)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import SequenceBiasLogitsProcessor

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.sampling.sampler import Sampler, SamplingBatch, apply_penalties
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.speculative import parse_speculative
from tests.gpu_worker.model_utils import (
    EOS_ID,
    HFReference,
    make_copier_checkpoint,
    random_prompts,
)
from tests.gpu_worker.runner_driver import Driver, checkpoint, make_runner
from tests.gpu_worker.sampler_utils import make_rows
from tests.gpu_worker.sync_guard import forbid_host_sync

V = 50


def test_bias_is_added_before_the_penalties() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g) * 3
    st, hints = make_rows([{"temperature": 0.0, "repetition_penalty": 1.5},
                           {"temperature": 0.0}, {"temperature": 0.0}])
    # Row 0 biases id 0 too, which is also the padding id: padding must add nothing.
    st.bias_ids = torch.tensor([[0, 4, 9], [7, 0, 0], [0, 0, 0]])
    st.bias_values = torch.tensor([[2.5, -100.0, 100.0], [-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    seen = torch.zeros(3, V, dtype=torch.bool)
    seen[0, [4, 9, 11]] = True
    got, owned = apply_penalties(logits, st, seen, torch.zeros(3, dtype=torch.int32), True,
                                 hints)
    want = logits.clone()
    want[0, 0] += 2.5
    want[0, 4] -= 100.0
    want[0, 9] += 100.0
    want[1, 7] -= 3.0
    rep = torch.where(want < 0, want * 1.5, want / 1.5)
    want[0] = torch.where(seen[0], rep[0], want[0])
    torch.testing.assert_close(got, want)
    assert owned and not torch.equal(got, logits)  # the caller's logits are left alone


def test_bias_moves_greedy_and_sampled_rows() -> None:
    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0
    st, hints = make_rows([{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1, "seed": 3},
                           {"temperature": 0.0}])
    st.bias_ids = torch.tensor([[7, 20], [7, 30], [0, 0]])
    st.bias_values = torch.tensor([[-100.0, 1.0], [-100.0, 100.0], [0.0, 0.0]])
    out = Sampler()(logits, SamplingBatch(st, hints=hints), torch.zeros(3, dtype=torch.int32))
    assert out.token_ids.tolist() == [20, 30, 7]


def test_a_guided_mask_beats_any_bias() -> None:
    """The guide's mask comes after the bias: +100 cannot make a forbidden token win, and
    the biased favourite among the allowed ones does."""
    logits = torch.zeros(2, V)
    st, hints = make_rows([{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
    st.bias_ids = torch.tensor([[30, 12], [30, 12]])
    st.bias_values = torch.tensor([[100.0, 50.0], [100.0, 50.0]])

    def forbid_30(x: torch.Tensor) -> None:
        x[:, 30] = float("-inf")

    out = Sampler()(logits, SamplingBatch(st, hints=hints), torch.zeros(2, dtype=torch.int32),
                    mask=forbid_30)
    assert out.token_ids.tolist() == [12, 12]


def _hf_biased(hf: HFReference, prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    gen = hf.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=n, min_new_tokens=n,
                            logits_processor=LogitsProcessorList([proc]))
    return list(gen[0, len(prompt):].tolist())


def biased(bias: dict[int, float], **kw: object) -> SamplingParams:
    return SamplingParams(logit_bias_ids=list(bias), logit_bias_values=list(bias.values()),
                          **kw)  # type: ignore[arg-type]


def test_runner_bias_across_plans_and_preemption_matches_hf(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    llama = checkpoint(tmp_path_factory.mktemp("bias-ckpt"), "llama-gqa")
    hf = HFReference(llama)
    prompts = random_prompts([12, 30, 7], 512, seed=21)
    n = 16
    plain = [hf.greedy(p, n) for p in prompts]
    # Ban each prompt's favourite first tokens, nudge others: the output must move.
    biases = [{plain[0][0]: -100.0, plain[0][1]: -100.0}, {plain[1][2]: -5.0, 17: 3.0},
              {plain[2][0]: -100.0, 99: 8.0, 301: 100.0}]
    want = [_hf_biased(hf, p, b, n) for p, b in zip(prompts, biases, strict=True)]
    d = Driver(make_runner(llama), seed=4)
    for rid, (p, b) in enumerate(zip(prompts, biases, strict=True)):
        d.add(rid, p, biased(b, max_new_tokens=n, min_new_tokens=n, stop_token_ids=[EOS_ID]))
    d.add(3, random_prompts([9], 512, seed=22)[0])  # an unbiased row in the same batch
    d.runner.step_guard = forbid_host_sync
    d.run(3)
    d.run(4)
    d.preempt(0)
    d.run(4)
    d.resume(0)
    d.run_until_done([4, 3])
    assert [d.reqs[i].out for i in range(3)] == want
    assert all(w != g[:n] for w, g in zip(want, plain, strict=True)), (want, plain)
    assert want[2] == [301] * n  # +100 wins every step


def _spec_run(model: str, spec: str, requests: list[tuple[list[int], SamplingParams]]
              ) -> dict[int, list[int]]:
    runner = ModelRunner(WorkerConfig(model, device="cpu", dtype="float32", num_kv_blocks=400,
                                      block_size=4, speculative=parse_speculative(spec)))
    runner.step_guard = forbid_host_sync
    d = Driver(runner)
    for i, (prompt, sampling) in enumerate(requests):
        d.add(i, prompt, sampling)
    for _ in range(60):
        if all(t.finish for t in d.reqs.values()):
            break
        d.run(4, True)
    return d.outputs()


def test_speculation_applies_the_same_bias(ckpt_root: Path) -> None:
    """Drafts copy the prompt's chain; a bias against one chain token must be honoured at
    every draft position, so the output equals the output without speculation."""
    copier = make_copier_checkpoint(ckpt_root, tokenizer=False)
    chain = _spec_run(copier, "", [([7], SamplingParams(max_new_tokens=30))])[0]
    prompt = [7] + chain[:24] + [7] + chain[:3]
    requests = [(prompt, biased({chain[6]: -100.0}, max_new_tokens=20)),
                (prompt, biased({chain[4]: -100.0, 5: 2.0}, max_new_tokens=20, temperature=0.8,
                                seed=9)),
                (prompt, SamplingParams(max_new_tokens=20))]
    want = _spec_run(copier, "", requests)
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
    got = _spec_run(copier, spec, requests)
    assert got == want
    assert want[0] != want[2] and chain[6] not in want[0]
