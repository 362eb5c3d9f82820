"""The soak's request mix: shares, and what each kind of request asks for."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem_serve.bench.soak.mix import DEFAULT_MIX, GUIDED, build, choose, parse_mix


def test_the_guided_share_is_of_all_requests_and_the_rest_keep_their_weights() -> None:
    mix = parse_mix("plain=3,cancel=1", 0.2)
    assert mix == pytest.approx({"plain": 0.6, "cancel": 0.2, "guided": 0.2})
    assert "guided" not in parse_mix(DEFAULT_MIX, 0.0)
    rng = random.Random(0)
    counts = Counter(choose(rng, mix) for _ in range(5000))
    assert abs(counts["guided"] / 5000 - 0.2) < 0.03


@pytest.mark.parametrize("text, share, message", [
    ("plain=1,bogus=2", 0.0, "unknown kind 'bogus'"),
    ("guided=1", 0.0, "unknown kind 'guided'"),  # its share is --guided-share
    ("plain=0", 0.0, "positive weight"),
    ("plain=1", 1.5, "--guided-share"),
])
def test_bad_mixes_name_the_problem(text: str, share: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mix(text, share)


def test_each_kind_asks_for_its_output_path() -> None:
    from tandem_serve.proto import generation_pb2 as pb

    def req(kind: str, seed: int = 1) -> pb.SingleGenerationRequest:
        return build(kind, random.Random(seed), seed, 64)

    assert req("detail").params.response.top_n_tokens == 3
    assert req("detail").params.response.token_logprobs
    assert len(req("stop").params.stopping.stop_sequences) == 2
    assert req("sample").params.method == pb.SAMPLE and req("sample").params.sampling.seed == 1
    cancel = req("cancel").params.stopping
    assert cancel.max_new_tokens == cancel.min_new_tokens == 64  # long enough to be cut
    kinds = {req("guided", s).params.decoding.WhichOneof("guided") for s in range(40)}
    assert kinds == {name for name, _ in GUIDED}
    assert req("plain").params.decoding.WhichOneof("guided") is None
