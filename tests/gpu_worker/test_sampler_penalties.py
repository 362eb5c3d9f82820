"""OpenAI's frequency and presence penalties: the sampler against the formula, the runner
against HF generate() with the same formula as a logits processor, across plans and a
preemption (the per-row counts are rebuilt from the kept history)."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tandem_serve.gpu_worker.sampling.sampler import (
    Sampler,
    SamplerHints,
    SamplingBatch,
    apply_penalties,
)
from tandem_serve.proto.request_params import SamplingParams
from tests.gpu_worker.model_utils import EOS_ID, HFReference, random_prompts
from tests.gpu_worker.runner_driver import Driver, checkpoint, make_runner
from tests.gpu_worker.sampler_utils import make_rows

V = 50


def reference(logits: torch.Tensor, outputs: list[list[int]], freq: list[float],
              pres: list[float], rep: list[float], prompts: list[list[int]]) -> torch.Tensor:
    """Row by row, the way the formula reads: HF's repetition penalty over prompt + output,
    then logit -= frequency * count + presence * (count > 0) over the output."""
    out = logits.clone()
    for i, toks in enumerate(outputs):
        for t in set(prompts[i] + toks):
            x = out[i, t]
            out[i, t] = x * rep[i] if x < 0 else x / rep[i]
        for t in set(toks):
            out[i, t] -= freq[i] * toks.count(t) + pres[i]
    return out


def counts_of(outputs: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros(len(outputs), V)
    for i, toks in enumerate(outputs):
        for t in toks:
            counts[i, t] += 1
    return counts


def seen_of(prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    seen = torch.zeros(len(outputs), V, dtype=torch.bool)
    for i, toks in enumerate(outputs):
        seen[i, prompts[i] + toks] = True
    return seen


def test_penalties_match_the_formula() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 3
    outputs = [[1, 1, 1, 7], [], [4, 9, 4], [2, 3, 5, 3, 3]]
    prompts = [[0, 1], [5], [9, 20], [2]]
    freq, pres, rep = [0.5, 1.0, -0.7, 0.0], [0.0, 1.5, 0.3, -2.0], [1.0, 1.0, 1.3, 0.8]
    st, hints = make_rows([{"temperature": 0.0, "repetition_penalty": r} for r in rep])
    st.frequency_penalty = torch.tensor(freq)
    st.presence_penalty = torch.tensor(pres)
    out_count = torch.tensor([len(o) for o in outputs], dtype=torch.int32)
    got, _ = apply_penalties(logits, st, seen_of(prompts, outputs), out_count, True, hints,
                             counts=counts_of(outputs))
    want = reference(logits, outputs, freq, pres, rep, prompts)
    torch.testing.assert_close(got, want)


def test_greedy_and_sampled_rows_see_the_penalties() -> None:
    """A large presence penalty moves the argmax off a repeated token for greedy rows, and
    the sampled rows draw from the penalised distribution."""
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0  # the favourite, already generated
    logits[:, 8] = 4.0
    st, hints = make_rows([{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1, "seed": 3}])
    st.frequency_penalty = torch.tensor([0.0, 0.0])
    st.presence_penalty = torch.tensor([2.0, 2.0])
    counts = counts_of([[7], [7]])
    out = Sampler()(logits, SamplingBatch(st, hints=hints, counts=counts, need_logprobs=True,
                                          max_top_n=2), torch.tensor([1, 1], dtype=torch.int32))
    assert out.token_ids.tolist() == [8, 8]
    assert out.top_ids is not None and out.top_ids[:, 0].tolist() == [8, 8]
    # Without counts nothing changes.
    plain = Sampler()(logits, SamplingBatch(st, hints=SamplerHints()), torch.tensor([1, 1],
                                                                                    dtype=torch.int32))
    assert plain.token_ids.tolist() == [7, 7]


class OpenAIPenalties(LogitsProcessor):
    """The formula as an HF logits processor, over the tokens generated after the prompt."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return checkpoint(tmp_path_factory.mktemp("penalty-ckpt"), "llama-gqa")


def test_runner_penalties_across_plans_and_preemption_match_hf(llama: str) -> None:
    prompts = random_prompts([12, 30, 7], 512, seed=17)
    # Negative values favour repeats: greedy output here hardly repeats a token by itself.
    params = [(0.0, -30.0), (-8.0, 0.0), (2.0, 30.0)]
    n = 20
    hf = HFReference(llama)
    want = []
    for p, (f, pr) in zip(prompts, params, strict=True):
        ids = torch.tensor([p])
        gen = hf.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                logits_processor=LogitsProcessorList(
                                    [OpenAIPenalties(len(p), f, pr)]))
        want.append(gen[0, len(p):].tolist())
    d = Driver(make_runner(llama), seed=2)
    for rid, (p, (f, pr)) in enumerate(zip(prompts, params, strict=True)):
        d.add(rid, p, SamplingParams(max_new_tokens=n, min_new_tokens=n, frequency_penalty=f,
                                     presence_penalty=pr, stop_token_ids=[EOS_ID]))
    d.add(3, random_prompts([9], 512, seed=18)[0])  # an unpenalised row in the same batch
    d.run(3)
    d.run(4)
    d.preempt(1)  # its counts come back from the history it keeps
    d.run(4)
    d.resume(1)
    d.run_until_done([4, 3])
    assert [d.reqs[i].out for i in range(3)] == want
    # The penalties did change the output (else this would test plain greedy).
    plain = [hf.greedy(p, n) for p in prompts]
    assert all(w != g[:n] for w, g in zip(want, plain, strict=True)), (want, plain)
