"""Speculative decoding (n-gram drafts) inside the K-step loop: the proposer against a plain
Python reference, acceptance and cutting units, and the runner's output with speculation
equal to its output without, token for token, with drafts accepted."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.sampling.sampler import Sampler, SamplingBatch
from tandem_serve.gpu_worker.spec.batch import accept_prefix, finish_run
from tandem_serve.gpu_worker.spec.ngram import propose_ngram
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.guided_messages import GuidedTable
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.speculative import parse_speculative
from tandem_serve.proto.token_messages import TokenBatch
from tests.gpu_worker.guided_utils import guided, hf_guided, table
from tests.gpu_worker.model_utils import EOS_ID, make_copier_checkpoint
from tests.gpu_worker.runner_driver import Driver
from tests.gpu_worker.sampler_utils import make_rows
from tests.gpu_worker.sync_guard import forbid_host_sync


def reference_ngram(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix n-gram with an earlier occurrence; the most recent one's
    continuation (up to k tokens)."""
    size = len(history)
    for n in range(n_max, n_min - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if history[start: start + n] == history[size - n:]:
                return history[start + n: start + n + k]
    return []


@pytest.mark.parametrize("k, n_min, n_max", [(4, 2, 4), (3, 1, 3), (5, 3, 3)])
def test_proposer_matches_the_reference(k: int, n_min: int, n_max: int) -> None:
    rng = random.Random(k * 10 + n_min)
    for _ in range(20):
        rows = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
        width = max(map(len, rows)) + rng.randrange(0, 5)
        history = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            history[i, : len(r)] = torch.tensor(r)
        lens = torch.tensor([len(r) for r in rows])
        with forbid_host_sync():
            drafts, length = propose_ngram(history, lens, k, n_min, n_max)
        for i, r in enumerate(rows):
            want = reference_ngram(r, k, n_min, n_max)
            assert int(length[i]) == len(want), (r, want)
            assert drafts[i, : len(want)].tolist() == want


def test_accept_and_cut_runs() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 3]])
    length = torch.tensor([3, 3, 1, 0])
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    accepted = accept_prefix(drafts, length, target)
    assert accepted.tolist() == [3, 1, 1, 0]
    stop = torch.tensor([[7], [-1], [-1], [-1]])
    tokens, finish, count = finish_run(
        target, accepted, torch.tensor([True, True, True, True]),
        torch.tensor([0, 0, 0, 0], dtype=torch.int32),
        torch.tensor([99, 99, 1, 99], dtype=torch.int32), stop, torch.zeros(4, dtype=torch.int64),
        1000)
    # Row 0 stops at its stop id inside the accepted run; row 2 at max_new_tokens=1.
    assert tokens.tolist() == [[5, 6, 7, -1], [5, 9, -1, -1], [5, -1, -1, -1], [1, -1, -1, -1]]
    assert count.tolist() == [3, 2, 1, 1]
    assert finish[0].tolist() == [0, 0, int(FinishReason.EOS_TOKEN), 0]
    assert finish[2, 0] == int(FinishReason.MAX_TOKENS)


@pytest.fixture(scope="module")
def copier(ckpt_root: Path) -> str:
    """Nearly a bigram model (see make_copier_checkpoint)."""
    return make_copier_checkpoint(ckpt_root, tokenizer=False)


SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'


def _run(model: str, spec: str, k: int, per_step: bool,
         requests: list[tuple[list[int], SamplingParams]], guard: bool = False,
         tables: tuple[GuidedTable, ...] = (), attention_backend: str = "auto"
         ) -> tuple[dict[int, list[int]], dict[int, FinishReason], Driver]:
    runner = ModelRunner(WorkerConfig(model, device="cpu", dtype="float32", num_kv_blocks=400,
                                      block_size=4, speculative=parse_speculative(spec),
                                      attention_backend=attention_backend))
    if guard:
        runner.step_guard = forbid_host_sync
    d = Driver(runner)
    for t in tables:
        d.send_table(t)
    for i, (prompt, sampling) in enumerate(requests):
        d.add(i, prompt, sampling)
    for _ in range(120):
        if all(t.finish for t in d.reqs.values()):
            break
        d.run(k, per_step)
    return d.outputs(), {rid: t.finish for rid, t in d.reqs.items()}, d


def _chain_of(model: str) -> list[int]:
    """Greedy output from one token: the chain the copy-heavy prompts repeat."""
    out, _, _ = _run(model, "", 8, True, [([7], SamplingParams(max_new_tokens=40))])
    return [7] + out[0]


@pytest.fixture(scope="module")
def chain(copier: str) -> list[int]:
    return _chain_of(copier)


def _requests(chain: list[int]) -> list[tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(max_new_tokens=30, stop_token_ids=[EOS_ID])
    return [
        (chain[:30] + chain[:3], greedy),
        (chain[5:25] + chain[5:8], SamplingParams(max_new_tokens=13)),  # cut inside a run
        # Row 0 again, given a stop id inside its first accepted run (in the test).
        (chain[:30] + chain[:3], SamplingParams(max_new_tokens=30)),
        # Rows that do not speculate ride along unchanged: seeded sampling, penalties.
        (chain[:12], SamplingParams(max_new_tokens=20, temperature=0.9, seed=11)),
        (chain[:12] + chain[:4], SamplingParams(max_new_tokens=20, repetition_penalty=1.3)),
        ([3, 1, 4, 1, 5], greedy),
        # min_new_tokens holds every stop id off, at every draft position too.
        # Given a stop id it reaches early (in the test), held off by min_new_tokens.
        (chain[:20] + chain[:3], SamplingParams(max_new_tokens=24)),
        # Logprobs and top-n of every emitted token, from its own position's distribution.
        (chain[:30] + chain[:3], SamplingParams(max_new_tokens=20, logprobs=True, top_n=3)),
    ]


def token_details(d: Driver, rid: int) -> list[tuple[float, int, list[int]]]:
    """Each emitted token's logprob, rank and top-n ids, in order."""
    out = []
    for m in d.messages:
        if isinstance(m, TokenBatch) and rid in m.request_ids.tolist():
            i = m.request_ids.tolist().index(rid)
            if m.token_ids[i] >= 0:
                assert m.logprobs is not None and m.ranks is not None and m.top_ids is not None
                out.append((float(m.logprobs[i]), int(m.ranks[i]), m.top_ids[i].tolist()))
    return out


@pytest.mark.parametrize("k, per_step", [(8, True), (1, False), (3, True)])
def test_greedy_output_equals_output_without_speculation(copier: str, chain: list[int],
                                                         k: int, per_step: bool) -> None:
    requests = _requests(chain)
    first, _, _ = _run(copier, "", k, per_step, [requests[2], requests[6]])
    requests[2] = (requests[2][0], SamplingParams(max_new_tokens=30,
                                                  stop_token_ids=[first[0][3]]))
    requests[6] = (requests[6][0], SamplingParams(max_new_tokens=24, min_new_tokens=17,
                                                  stop_token_ids=[first[1][8]]))
    want, want_finish, plain = _run(copier, "", k, per_step, requests)
    got, got_finish, d = _run(copier, SPEC, k, per_step, requests, guard=True)
    assert got == want
    for (lp, ranks, top), (lp2, ranks2, top2) in zip(token_details(plain, 7), token_details(d, 7),
                                                     strict=True):
        assert abs(lp - lp2) < 1e-4 and ranks == ranks2 and top == top2
    assert got_finish == want_finish
    assert want_finish[2] == FinishReason.EOS_TOKEN and len(want[2]) == 4
    # ... and the stop came inside a verify step's run, not at its first token.
    ends = [m.step for m in d.messages if isinstance(m, TokenBatch)
            for rid, fin in zip(m.request_ids.tolist(), m.finish.tolist(), strict=True)
            if rid == 2 and fin]
    assert len(ends) == 1 and ends[0] % d.stride == 3
    assert len(want[1]) == 13
    assert len(want[6]) >= 17 and want[6][:17] != first[1][:17]  # the stop id was held off
    accepted = sum(done.num_accepted_tokens for done in d.done)
    drafted = sum(done.num_draft_tokens for done in d.done)
    assert 0 < accepted <= drafted and sum(done.num_drafts for done in d.done) > 0
    # Per draft position: they add up, and a later draft is only kept after the earlier.
    at = np.sum([done.num_accepted_per_pos for done in d.done if done.num_accepted_per_pos],
                axis=0)
    assert len(at) == 4 and at.sum() == accepted and at[0] > 0
    assert all(at[j] >= at[j + 1] for j in range(3))
    # Fewer verify steps than tokens: rows advanced several tokens in some steps.
    steps = sum(1 for done in d.done for _ in range(k))
    assert sum(len(v) for v in got.values()) > steps


def test_preempt_and_resume_keep_parity(copier: str, chain: list[int]) -> None:
    requests = _requests(chain)[:2]
    outs = []
    for spec in ("", SPEC):
        runner = ModelRunner(WorkerConfig(copier, device="cpu", dtype="float32",
                                          num_kv_blocks=400, block_size=4,
                                          speculative=parse_speculative(spec)))
        d = Driver(runner)
        for i, (prompt, sampling) in enumerate(requests):
            d.add(i, prompt, sampling)
        d.run(4)
        d.preempt(0)
        d.run(4)
        d.resume(0)
        for _ in range(40):
            if all(t.finish for t in d.reqs.values()):
                break
            d.run(4)
        outs.append(d.outputs())
    assert outs[0] == outs[1]
    assert np.all([len(v) for v in outs[0].values()])


def test_sampled_rows_keep_their_seeded_tokens(copier: str, chain: list[int]) -> None:
    """A sampled row's draft is kept when the token sampled at its position (same seed and
    output count as without speculation) equals it: the one-hot rejection rule, so a seeded
    row gets exactly the tokens it gets without speculation, and drafts are still accepted."""
    prompt = chain[:30] + chain[:3]
    requests = [(prompt, SamplingParams(max_new_tokens=24, temperature=t, seed=seed, top_k=k,
                                        top_p=p, min_p=m))
                for seed, (t, k, p, m) in enumerate([(0.3, 0, 1.0, 0.0), (0.7, 20, 0.9, 0.0),
                                                     (1.0, 0, 1.0, 0.05), (0.5, 5, 1.0, 0.0)])]
    want, _, _ = _run(copier, "", 8, True, requests)
    got, _, d = _run(copier, SPEC, 8, True, requests, guard=True)
    assert got == want
    assert sum(done.num_accepted_tokens for done in d.done) > 0


def test_one_hot_rejection_keeps_the_target_distribution() -> None:
    """Accepting draft t when the token sampled at its position is t is the rejection rule
    for a one-hot draft: accepted with probability p(t); on rejection the emitted token is
    distributed as p without t, renormalised.  Checked over 20,000 seeds of one row."""
    n, draft = 20_000, 1
    probs = torch.tensor([0.1, 0.45, 0.25, 0.2])
    st, hints = make_rows([dict(temperature=1.0, seed=s) for s in range(n)])
    logits = probs.log().repeat(n, 1)
    tokens = Sampler()(logits, SamplingBatch(st, hints=hints), torch.zeros(n, dtype=torch.int32))
    drafts = torch.full((n, 1), draft)
    target = torch.stack((tokens.token_ids, tokens.token_ids), dim=1)
    accepted = accept_prefix(drafts, torch.ones(n, dtype=torch.int64), target)
    rate = accepted.double().mean().item()
    assert abs(rate - probs[draft].item()) < 4 * (0.45 * 0.55 / n) ** 0.5
    rejected = tokens.token_ids[accepted == 0]
    assert not (rejected == draft).any()
    residual = probs.clone()
    residual[draft] = 0
    residual /= residual.sum()
    freq = torch.bincount(rejected, minlength=4).double() / len(rejected)
    bound = 4 * (residual.double() * (1 - residual.double()) / len(rejected)).sqrt()
    assert ((freq - residual.double()).abs() <= bound + 1e-12).all()


@pytest.fixture(scope="module")
def copier_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The copier with its tokenizer: regexes need text."""
    return make_copier_checkpoint(tmp_path_factory.mktemp("copier-text"))


NO_Q = "[^q]*"  # the copier's chain holds " quick": the guide forbids that draft


@pytest.mark.parametrize("k, per_step, method", [(8, True, "ngram"), (1, False, "ngram"),
                                                 (8, True, "draft_model")])
def test_guided_and_penalty_rows_speculate_exactly(copier_text: str, k: int,
                                                   per_step: bool, method: str) -> None:
    """Guided table rows and penalty rows speculate: each draft position is sampled after
    the drafts before it (guided state along the draft path, penalty tables counting them),
    so the output equals the plain run's, a guided greedy row equals HF generate() under the
    regex, and drafts are accepted for them."""
    chain = _chain_of(copier_text)
    prompt = chain[:30] + chain[:3]
    spec_text = SPEC if method == "ngram" else json.dumps(  # the model as its own draft
        {"method": "draft_model", "model": copier_text, "num_speculative_tokens": 4})
    t = table(copier_text, NO_Q)
    runs = {
        "guided": [(prompt, guided(t, 30)),
                   (chain[2:30] + chain[2:5], guided(t, 30, temperature=0.8, seed=3))],
        "penalties": [(prompt, SamplingParams(max_new_tokens=30, repetition_penalty=1.2)),
                      (prompt, SamplingParams(max_new_tokens=30, frequency_penalty=0.4,
                                              presence_penalty=0.3, temperature=0.7, seed=9))],
    }
    for name, requests in runs.items():
        want, _, _ = _run(copier_text, "", k, per_step, requests, True, (t,))
        got, _, d = _run(copier_text, spec_text, k, per_step, requests, True, (t,))
        assert got == want, name
        assert sum(done.num_accepted_tokens for done in d.done) > 0, name
        if name == "guided":
            assert got[0] == hf_guided(copier_text, NO_Q, prompt, len(got[0])), got[0]
