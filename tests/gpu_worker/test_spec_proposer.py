"""The speculative methods' interface (`gpu_worker.spec.proposer`) and registry
(`gpu_worker.spec.registry`): every method the config accepts has a proposer and no other
does; and a method known only to the registry, whose proposer offers a fixed continuation,
gets exactly the acceptance its drafts earn from a verify step on a tiny model, with the
output of plain steps."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.spec.draft_model import DraftModel
from tandem_serve.gpu_worker.spec.ngram import NgramProposer
from tandem_serve.gpu_worker.spec.proposer import DraftInputs, Proposer
from tandem_serve.gpu_worker.spec.registry import PROPOSERS, ProposerContext, make_proposer
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.speculative import METHODS, SpeculativeConfig, parse_speculative
from tests.gpu_worker.model_utils import make_copier_checkpoint
from tests.gpu_worker.runner_driver import Driver
from tests.gpu_worker.sync_guard import forbid_host_sync

VOCAB = 512  # the tiny checkpoints'
CTX = ProposerContext(VOCAB, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def copier(ckpt_root: Path) -> str:
    return make_copier_checkpoint(ckpt_root, tokenizer=False)


def test_the_registry_builds_every_method_the_config_accepts(copier: str) -> None:
    assert set(PROPOSERS) == set(METHODS)
    assert make_proposer(None, CTX) is None
    ngram = make_proposer(parse_speculative(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'), CTX)
    assert isinstance(ngram, NgramProposer) and (ngram.n_min, ngram.n_max) == (2, 5)
    # Prompt lookup has no cache and no cost worth timing: the interface's defaults.
    assert ngram.kv_bytes_per_block(16, torch.float32) == 0
    assert ngram.step_cost(3, lambda forward: forward) is None
    draft = make_proposer(parse_speculative(
        f'{{"method": "draft_model", "model": "{copier}", "num_speculative_tokens": 3}}'), CTX)
    assert isinstance(draft, DraftModel) and draft.kv_bytes_per_block(16, torch.float32) > 0
    # What it holds of a request: folded in after a plan, forgotten on preemption.
    req = RequestState(0, list(range(10)), 6, SamplingParams())
    draft.end_plan([req])
    assert req.draft_len == 8
    draft.preempted(req)
    assert req.draft_len == 0


def test_an_unknown_method_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="method 'eagle' is not one of ngram, draft_model"):
        parse_speculative('{"method": "eagle", "num_speculative_tokens": 3}')
    # A config built past the parser (the worker's own check).
    with pytest.raises(ValueError, match="--speculative-config: method 'eagle' is not one of "
                                         "ngram, draft_model"):
        make_proposer(SpeculativeConfig("eagle", 3), CTX)


class KnownContinuation(Proposer):
    """Proposes the one request's known greedy continuation, each draft from `wrong_from`
    on replaced by another token."""

    def __init__(self, sequence: list[int], wrong_from: int) -> None:
        self.sequence = torch.tensor(sequence)
        self.wrong_from = wrong_from
        self.plans = 0

    def start_plan(self, reqs: list[RequestState]) -> None:
        self.plans += 1

    def propose(self, rows: DraftInputs) -> tuple[Tensor, Tensor]:
        j = torch.arange(rows.k)
        # The token after the input is sequence[hist_len]: draft j must equal the one after.
        at = (rows.hist_len.unsqueeze(1) + j).clamp(max=len(self.sequence) - 1)
        drafts = self.sequence[at]
        drafts = torch.where(j >= self.wrong_from, (drafts + 1) % VOCAB, drafts)
        return drafts, torch.full_like(rows.hist_len, rows.k)


def _run(copier: str, spec: SpeculativeConfig | None) -> tuple[list[int], Driver]:
    runner = ModelRunner(WorkerConfig(copier, device="cpu", dtype="float32", num_kv_blocks=64,
                                      block_size=4, speculative=spec))
    runner.step_guard = forbid_host_sync
    d = Driver(runner)
    d.add(0, [7, 30, 41, 7, 30], SamplingParams(max_new_tokens=20))
    for _ in range(20):
        if d.reqs[0].finish:
            break
        d.run(4)
    return d.outputs()[0], d


@pytest.mark.parametrize("wrong_from", [3, 1, 0])
def test_a_proposer_gets_the_acceptance_its_drafts_earn(
        copier: str, wrong_from: int, monkeypatch: pytest.MonkeyPatch) -> None:
    want, _ = _run(copier, None)
    prompt = [7, 30, 41, 7, 30]
    fake = KnownContinuation(prompt + want, wrong_from)
    monkeypatch.setitem(PROPOSERS, "fixed", lambda config, ctx: fake)
    got, d = _run(copier, SpeculativeConfig("fixed", 3, adaptive=False))
    assert got == want and fake.plans > 0
    drafts = sum(x.num_drafts for x in d.done)
    tokens = sum(x.num_draft_tokens for x in d.done)
    accepted = sum(x.num_accepted_tokens for x in d.done)
    per_pos = [sum(p) for p in zip(*(x.num_accepted_per_pos for x in d.done
                                     if x.num_accepted_per_pos), strict=True)]
    assert drafts > 0 and tokens >= drafts
    # Each step keeps its drafts up to the first wrong one, which the target replaces.
    if wrong_from == 3:
        assert accepted == tokens and per_pos[0] == drafts and sum(per_pos) == accepted
    elif wrong_from == 1:
        assert accepted == drafts and per_pos == [drafts, 0, 0]
    else:
        assert accepted == 0 and per_pos == [0, 0, 0]
