"""`fmaas.GenerationService` over a real server: each RPC, and each parameter doing what its
TGIS semantics say.  One server for the module (max model length 256, to reach TOKEN_LIMIT
cheaply; float32 on any device, so greedy text is the same everywhere).  The prompt "Hello 0"
ends with EOS after 96 greedy tokens on the tiny model, which the EOS, min_new_tokens,
length_penalty and stop-sequence checks lean on.
"""
from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
EOS_PROMPT = "Hello 0"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--max-model-len", str(MAX_MODEL_LEN),
                          "--dtype", "float32")


def stream(server: Server, text: str, **opts: object) -> list[pb.GenerationResponse]:
    return list(server.client.stream(text, GenerateOptions(**opts), timeout=60))  # type: ignore[arg-type]


def generated(msgs: list[pb.GenerationResponse]) -> str:
    return "".join(m.text for m in msgs[1:])


def concurrently(server: Server, *calls: tuple[str, dict]) -> list[list[pb.GenerationResponse]]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: stream(server, c[0], **c[1]), calls))


@pytest.fixture(scope="module")
def eos_run(server: Server) -> list[pb.GenerationResponse]:
    return stream(server, EOS_PROMPT, max_new_tokens=200)


@pytest.fixture(scope="module")
def eos_at(eos_run: list[pb.GenerationResponse]) -> int:
    """Greedy tokens of EOS_PROMPT up to and including EOS (96 with the tiny default model)."""
    last = eos_run[-1]
    if last.stop_reason != pb.EOS_TOKEN or last.generated_token_count < 60:
        pytest.skip(f"{EOS_PROMPT!r} does not end with a late EOS on this model: {last}")
    return int(last.generated_token_count)


# ---------------------------------------------------------------------- GenerateStream


def test_stream_message_layout(server: Server) -> None:
    msgs = stream(server, PROMPT, max_new_tokens=12, generated_tokens=True)
    head, body = msgs[0], msgs[1:]
    n_prompt = server.client.tokenize([PROMPT])[0].token_count
    # First: the input side only.
    assert head.input_token_count == n_prompt
    assert (head.text, head.generated_token_count, len(head.tokens)) == ("", 0, 0)
    assert head.stop_reason == pb.NOT_FINISHED
    # Then: deltas with a cumulative count and one TokenInfo per new token.
    count = 0
    for m in body:
        assert m.generated_token_count == count + len(m.tokens)
        count = m.generated_token_count
        assert m.input_token_count == 0
    assert all(m.stop_reason == pb.NOT_FINISHED for m in body[:-1])
    last = body[-1]
    assert (last.stop_reason, last.generated_token_count, last.seed) == (pb.MAX_TOKENS, 12, 0)
    # The streamed text is the batched RPC's text.
    (full,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=12))
    assert generated(msgs) == full.text and full.generated_token_count == 12


def test_input_text_and_input_tokens(server: Server) -> None:
    msgs = stream(server, PROMPT, max_new_tokens=3, input_text=True, input_tokens=True)
    head = msgs[0]
    assert head.text == PROMPT
    tokens = list(server.client.tokenize([PROMPT])[0].tokens)
    assert [t.text for t in head.input_tokens] == tokens and tokens[0] == "<s>"
    assert all(len(m.input_tokens) == 0 for m in msgs[1:])
    (resp,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=3, input_text=True,
                                                               input_tokens=True))
    assert resp.text == PROMPT + generated(msgs)
    assert [t.text for t in resp.input_tokens] == tokens


def test_truncate_input_tokens_keeps_the_end(server: Server) -> None:
    text = "one two three four five six seven eight nine ten"
    tokens = list(server.client.tokenize([text])[0].tokens)
    full, cut = concurrently(server, (text, dict(max_new_tokens=4)),
                             (text, dict(max_new_tokens=4, truncate_input_tokens=5,
                                         input_tokens=True)))
    assert full[0].input_token_count == len(tokens) > 5
    assert cut[0].input_token_count == 5
    assert [t.text for t in cut[0].input_tokens] == tokens[-5:]
    # A prompt shorter than the limit is left alone.
    same = stream(server, text, max_new_tokens=4, truncate_input_tokens=100)
    assert same[0].input_token_count == len(tokens) and generated(same) == generated(full)


# ---------------------------------------------------------------------- stopping


def test_max_new_tokens_ends_with_max_tokens(server: Server) -> None:
    for n in (1, 7):
        msgs = stream(server, PROMPT, max_new_tokens=n)
        assert (msgs[-1].stop_reason, msgs[-1].generated_token_count) == (pb.MAX_TOKENS, n)


def test_default_max_new_tokens_is_the_server_default(server: Server) -> None:
    msgs = stream(server, PROMPT)
    assert (msgs[-1].stop_reason, msgs[-1].generated_token_count) == (pb.MAX_TOKENS, 20)


def test_model_length_ends_with_token_limit(server: Server) -> None:
    text = " ".join(["hello"] * 124)
    n_prompt = server.client.tokenize([text])[0].token_count
    assert MAX_MODEL_LEN - 20 < n_prompt < MAX_MODEL_LEN
    msgs = stream(server, text, max_new_tokens=40)
    assert msgs[-1].stop_reason == pb.TOKEN_LIMIT
    assert msgs[-1].generated_token_count == MAX_MODEL_LEN - n_prompt


def test_eos_ends_with_its_text(eos_run: list[pb.GenerationResponse], eos_at: int) -> None:
    last = eos_run[-1]
    assert (last.stop_reason, last.stop_sequence) == (pb.EOS_TOKEN, "</s>")
    assert last.generated_token_count == eos_at == 96


def test_min_new_tokens_suppresses_eos(server: Server,
                                       eos_run: list[pb.GenerationResponse],
                                       eos_at: int) -> None:
    msgs = stream(server, EOS_PROMPT, max_new_tokens=eos_at + 4, min_new_tokens=eos_at + 2)
    assert msgs[-1].stop_reason == pb.MAX_TOKENS
    assert msgs[-1].generated_token_count == eos_at + 4
    # Identical up to where EOS would have come.
    assert generated(msgs).startswith(generated(eos_run))


def test_length_penalty_brings_eos_earlier(server: Server, eos_run: list[pb.GenerationResponse],
                                           eos_at: int) -> None:
    mild, late, strong, strong_min = concurrently(
        server,
        (EOS_PROMPT, dict(max_new_tokens=120, length_penalty=(0, 1.1))),
        (EOS_PROMPT, dict(max_new_tokens=120, length_penalty=(50, 1.5))),
        (EOS_PROMPT, dict(max_new_tokens=120, length_penalty=(0, 10.0))),
        (EOS_PROMPT, dict(max_new_tokens=120, length_penalty=(0, 10.0), min_new_tokens=6)))
    counts = [m[-1].generated_token_count for m in (strong, mild, late)]
    assert all(m[-1].stop_reason == pb.EOS_TOKEN for m in (mild, late, strong, strong_min))
    assert counts == sorted(counts) and counts[-1] < eos_at
    # The penalty only starts at start_index: before it the text is the unpenalised one.
    assert late[-1].generated_token_count > 50
    assert generated(eos_run).startswith(generated(late))
    # min_new_tokens still holds EOS back.
    assert 6 < strong_min[-1].generated_token_count < eos_at


def test_stop_sequence_include_and_exclude(server: Server, eos_run: list[pb.GenerationResponse],
                                           eos_at: int) -> None:
    text = generated(eos_run)
    at = next(i for i in range(15, len(text) - 4)
              if text.index(text[i:i + 4]) == i and text[i:i + 4].strip() == text[i:i + 4])
    stop = text[at:at + 4]
    incl, excl, default = concurrently(
        server,
        (EOS_PROMPT, dict(max_new_tokens=120, stop_sequences=[stop, "never-there"],
                          include_stop_sequence=True)),
        (EOS_PROMPT, dict(max_new_tokens=120, stop_sequences=[stop],
                          include_stop_sequence=False)),
        (EOS_PROMPT, dict(max_new_tokens=120, stop_sequences=[stop])))
    for msgs in (incl, excl, default):
        assert (msgs[-1].stop_reason, msgs[-1].stop_sequence) == (pb.STOP_SEQUENCE, stop)
        assert msgs[-1].generated_token_count < eos_at
    assert generated(incl) == text[:at + 4]
    assert generated(excl) == text[:at]
    assert generated(default) == text[:at + 4]  # the server default includes it


def test_time_limit_returns_the_text_so_far(server: Server,
                                            eos_run: list[pb.GenerationResponse]) -> None:
    # The limit is set from this machine's speed, to fall well inside the 250 tokens: a fixed
    # one is either too short for a busy machine or too long for a fast one.
    started = time.monotonic()
    stream(server, EOS_PROMPT, max_new_tokens=50, min_new_tokens=50)
    expected_s = (time.monotonic() - started) * 250 / 50
    msgs = stream(server, EOS_PROMPT, max_new_tokens=250, min_new_tokens=250,
                  time_limit_millis=max(50, int(expected_s * 1000 * 0.4)))
    last = msgs[-1]
    assert last.stop_reason == pb.TIME_LIMIT
    assert 0 < last.generated_token_count < 250
    so_far, eos_text = generated(msgs), generated(eos_run)
    assert so_far and (eos_text.startswith(so_far) or so_far.startswith(eos_text))


# ---------------------------------------------------------------------- token detail


def test_token_logprobs_ranks_and_top_n(server: Server) -> None:
    greedy = stream(server, PROMPT, max_new_tokens=10, generated_tokens=True,
                    token_logprobs=True, token_ranks=True, top_n_tokens=4)
    infos = [t for m in greedy[1:] for t in m.tokens]
    assert len(infos) == 10
    for t in infos:
        assert t.rank == 1  # greedy picks the most likely token
        assert math.isfinite(t.logprob) and t.logprob <= 0
        alts = [a.logprob for a in t.top_tokens]
        assert len(alts) == 4 and alts == sorted(alts, reverse=True)
        assert all(a <= t.logprob + 1e-5 for a in alts)
        assert alts[0] == pytest.approx(t.logprob, abs=1e-5)
        assert t.top_tokens[0].text == t.text


def test_each_detail_flag_alone(server: Server) -> None:
    lp, rank, top, none = concurrently(
        server,
        (PROMPT, dict(max_new_tokens=4, generated_tokens=True, token_logprobs=True)),
        (PROMPT, dict(max_new_tokens=4, generated_tokens=True, token_ranks=True)),
        (PROMPT, dict(max_new_tokens=4, generated_tokens=True, top_n_tokens=2)),
        (PROMPT, dict(max_new_tokens=4, generated_tokens=True)))
    for msgs, want in ((lp, "logprob"), (rank, "rank"), (top, "top"), (none, "")):
        infos = [t for m in msgs[1:] for t in m.tokens]
        assert len(infos) == 4 and all(t.text for t in infos)
        assert all((t.logprob != 0) == (want == "logprob") for t in infos)
        assert all((t.rank != 0) == (want == "rank") for t in infos)
        assert all(len(t.top_tokens) == (2 if want == "top" else 0) for t in infos)


def test_sampled_ranks_go_past_one(server: Server) -> None:
    msgs = stream(server, PROMPT, max_new_tokens=24, sample=True, seed=3, temperature=2.0,
                  generated_tokens=True, token_ranks=True, token_logprobs=True)
    ranks = [t.rank for m in msgs[1:] for t in m.tokens]
    assert all(r >= 1 for r in ranks) and max(ranks) > 1


# ---------------------------------------------------------------------- sampling


def test_seed_reproduces_and_is_returned(server: Server) -> None:
    a, b, c, unseeded = concurrently(
        server,
        (PROMPT, dict(max_new_tokens=16, sample=True, seed=11)),
        (PROMPT, dict(max_new_tokens=16, sample=True, seed=11)),
        (PROMPT, dict(max_new_tokens=16, sample=True, seed=12)),
        (PROMPT, dict(max_new_tokens=16, sample=True)))
    assert generated(a) == generated(b) != generated(c)
    assert (a[-1].seed, c[-1].seed) == (11, 12)
    # The seed the server picked reproduces its output.
    seed = unseeded[-1].seed
    assert seed != 0
    again = stream(server, PROMPT, max_new_tokens=16, sample=True, seed=seed)
    assert generated(again) == generated(unseeded)


def test_sampling_parameters_change_the_output(server: Server) -> None:
    base = dict(max_new_tokens=16, sample=True, seed=5)
    greedy, plain, cold, top_k1, top_k5, top_p, typical, temp0 = concurrently(
        server,
        (PROMPT, dict(max_new_tokens=16)),
        (PROMPT, base),
        (PROMPT, {**base, "temperature": 0.4}),
        (PROMPT, {**base, "top_k": 1}),
        (PROMPT, {**base, "top_k": 5}),
        (PROMPT, {**base, "top_p": 0.01}),
        (PROMPT, {**base, "typical_p": 0.3}),
        (PROMPT, {**base, "temperature": 0.0}))
    text = {k: generated(v) for k, v in dict(
        greedy=greedy, plain=plain, cold=cold, top_k1=top_k1, top_k5=top_k5, top_p=top_p,
        typical=typical, temp0=temp0).items()}
    assert text["plain"] != text["greedy"]
    for name in ("cold", "top_k5", "typical"):
        assert text[name] != text["plain"], name
    # Cut-offs that keep only the most likely token, and temperature 0, are greedy.
    assert text["top_k1"] == text["top_p"] == text["temp0"] == text["greedy"]
    assert temp0[-1].seed == 0 and plain[-1].seed == 5


def test_repetition_penalty_changes_greedy_output(server: Server) -> None:
    opts = dict(max_new_tokens=60, generated_tokens=True)
    plain, penalised = concurrently(server, (PROMPT, opts),
                                    (PROMPT, {**opts, "repetition_penalty": 2.0}))
    prompt_tokens = list(server.client.tokenize([PROMPT])[0].tokens)
    ours = [t.text for m in plain[1:] for t in m.tokens]
    theirs = [t.text for m in penalised[1:] for t in m.tokens]
    # Greedy on the tiny model repeats a token within 60; the penalty changes exactly that pick.
    first_repeat = next(i for i, t in enumerate(ours) if t in prompt_tokens + ours[:i])
    assert theirs[:first_repeat] == ours[:first_repeat]
    assert theirs[first_repeat] != ours[first_repeat]
    assert penalised[-1].seed == 0


# ---------------------------------------------------------------------- Generate


def test_generate_answers_in_request_order(server: Server) -> None:
    texts = ["The first prompt", "Second", "and the third one, which is longer than the others"]
    opts = GenerateOptions(max_new_tokens=6, input_text=True)
    singles = concurrently(server, *[(t, dict(max_new_tokens=6)) for t in texts])
    batch = server.client.generate(texts, opts)
    assert len(batch) == 3
    for text, single, resp in zip(texts, singles, batch, strict=True):
        assert resp.text == text + generated(single)
        assert resp.input_token_count == single[0].input_token_count
        assert (resp.generated_token_count, resp.stop_reason) == (6, pb.MAX_TOKENS)


# ---------------------------------------------------------------------- Tokenize, ModelInfo


def test_tokenize_tokens_offsets_and_truncation(server: Server) -> None:
    texts = ["Hello world, this is Tandem.", "a  b"]
    out = server.client.tokenize(texts, tokens=True, offsets=True)
    for text, r in zip(texts, out, strict=True):
        assert r.token_count == len(r.tokens) == len(r.offsets)
        assert r.tokens[0] == "<s>" and (r.offsets[0].start, r.offsets[0].end) == (0, 0)
        pos = 0
        for tok, off in zip(r.tokens[1:], r.offsets[1:], strict=True):
            assert off.start == pos <= off.end  # contiguous cover of the text
            assert text[off.start:off.end].strip() == tok.replace("▁", " ").strip()
            pos = off.end
        assert pos == len(text)
    cut = server.client.tokenize(texts[:1], tokens=True, offsets=True, truncate=3)[0]
    assert cut.token_count == 3 and list(cut.tokens) == list(out[0].tokens[-3:])
    assert [(o.start, o.end) for o in cut.offsets] == \
        [(o.start, o.end) for o in out[0].offsets[-3:]]
    bare = server.client.tokenize(texts, tokens=False)
    assert [r.token_count for r in bare] == [r.token_count for r in out]
    assert all(len(r.tokens) == 0 and len(r.offsets) == 0 for r in bare)


def test_model_info(server: Server) -> None:
    info = server.client.model_info()
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert (info.max_sequence_length, info.max_new_tokens) == (MAX_MODEL_LEN, 1024)


# Last: until the gpu worker scores prompts this is the test that fails.
def test_input_token_logprobs_ranks_and_top_n(server: Server) -> None:
    msgs = stream(server, PROMPT, max_new_tokens=2, input_tokens=True, token_logprobs=True,
                  token_ranks=True, top_n_tokens=3)
    tokens = list(server.client.tokenize([PROMPT])[0].tokens)
    infos = list(msgs[0].input_tokens)
    assert [t.text for t in infos] == tokens
    # The first token has no prefix to be scored against.
    assert math.isnan(infos[0].logprob) and infos[0].rank == 0 and not infos[0].top_tokens
    for t in infos[1:]:
        assert math.isfinite(t.logprob) and t.logprob <= 0 and t.rank >= 1
        alts = [a.logprob for a in t.top_tokens]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert alts[0] >= t.logprob - 1e-5
        if t.rank == 1:
            assert alts[0] == pytest.approx(t.logprob, abs=1e-5)
    # Generated tokens carry no detail: only input tokens were asked for.
    assert all(len(m.tokens) == 0 for m in msgs[1:])
    (resp,) = server.client.generate([PROMPT], GenerateOptions(
        max_new_tokens=2, input_tokens=True, token_logprobs=True))
    assert [t.logprob for t in resp.input_tokens[1:]] == \
        pytest.approx([t.logprob for t in infos[1:]], abs=1e-5)
    assert all(t.rank == 0 and not t.top_tokens for t in resp.input_tokens)
