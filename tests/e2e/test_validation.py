"""Bad requests over a real server: INVALID_ARGUMENT naming the field (or UNIMPLEMENTED), and
a stream already in flight finishes with the same text as when it runs alone. Guided-decoding
constraints that do not compile are bad requests too."""
from __future__ import annotations

import math
import pathlib
import threading
from collections.abc import Iterator

import grpc
import pytest

from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
MAX_NEW_TOKENS = 100  # the server's cap
PROMPT = "Once upon a time"
LONG = "word " * 200  # ~200 tokens: over the max model length


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    srv = Server(str(tiny_model_dir), "--max-model-len", str(MAX_MODEL_LEN),
                 "--max-new-tokens", str(MAX_NEW_TOKENS)).wait_ready()
    try:
        # The guided compile worker starts on the first constraint: not while a test's
        # stream is timed against the bad requests.
        list(srv.client.stream(PROMPT, opts(max_new_tokens=2, regex="[0-9]+"), timeout=120))
        yield srv
    finally:
        assert srv.stop() == 0
    assert srv.leftovers() == []  # the compile worker went with the server


def opts(**kw: object) -> GenerateOptions:
    return GenerateOptions(**kw)  # type: ignore[arg-type]


# (id, prompt, options, field named in the message, a piece of the limit)
INVALID = [
    ("empty text", "", opts(), "request.text", "must not be empty"),
    ("prompt over max length", LONG, opts(), "request.text",
     f"max model length {MAX_MODEL_LEN}"),
    ("prompt + min_new_tokens over max length", "word " * 100,
     opts(max_new_tokens=40, min_new_tokens=40),
     "request.text", "min_new_tokens (40)"),
    ("max_new_tokens over the server max", PROMPT, opts(max_new_tokens=MAX_NEW_TOKENS + 1),
     "params.stopping.max_new_tokens", f"<= {MAX_NEW_TOKENS}"),
    ("min over max", PROMPT, opts(max_new_tokens=5, min_new_tokens=6),
     "params.stopping.min_new_tokens", "max_new_tokens (5)"),
    ("temperature < 0", PROMPT, opts(sample=True, temperature=-0.1),
     "params.sampling.temperature", ">= 0"),
    ("temperature NaN", PROMPT, opts(sample=True, temperature=math.nan),
     "params.sampling.temperature", "finite"),
    ("top_p > 1", PROMPT, opts(sample=True, top_p=1.5), "params.sampling.top_p", "[0, 1]"),
    ("typical_p > 1", PROMPT, opts(sample=True, typical_p=1.5), "params.sampling.typical_p",
     "[0, 1]"),
    # top_k < 0 cannot be sent: the field is a uint32.
    ("top_k over the vocabulary", PROMPT, opts(sample=True, top_k=32001),
     "params.sampling.top_k", "vocabulary size 32000"),
    ("7 stop sequences", PROMPT, opts(stop_sequences=list("abcdefg")),
     "params.stopping.stop_sequences", "at most 6"),
    ("empty stop sequence", PROMPT, opts(stop_sequences=["ok", ""]),
     "params.stopping.stop_sequences[1]", "1 to 240 UTF-8 bytes"),
    ("241-byte stop sequence", PROMPT, opts(stop_sequences=["x" * 241]),
     "params.stopping.stop_sequences[0]", "got 241"),
    ("top_n_tokens 11", PROMPT, opts(generated_tokens=True, top_n_tokens=11),
     "params.response.top_n_tokens", "<= 10"),
    ("token detail without tokens", PROMPT, opts(token_logprobs=True), "params.response",
     "require generated_tokens or input_tokens"),
    ("repetition_penalty 3", PROMPT, opts(repetition_penalty=3.0),
     "params.decoding.repetition_penalty", "(0, 2]"),
    ("length_penalty decay 0.5", PROMPT, opts(length_penalty=(2, 0.5)),
     "params.decoding.length_penalty.decay_factor", "[1, 10]"),
    ("length_penalty decay 11", PROMPT, opts(length_penalty=(2, 11.0)),
     "params.decoding.length_penalty.decay_factor", "[1, 10]"),
    ("malformed regex", PROMPT, opts(regex="[0-9"), "params.decoding.regex",
     "unclosed character class"),
    ("look-around regex", PROMPT, opts(regex="(?=a)b"), "params.decoding.regex",
     "look-around"),
    ("schema not JSON", PROMPT, opts(json_schema='{"type": '), "params.decoding.json_schema",
     "not valid JSON"),
    ("unsupported schema", PROMPT, opts(json_schema='{"type": "string", "format": "nope"}'),
     "params.decoding.json_schema", "unsupported JSON schema"),
    ("grammar syntax error", PROMPT, opts(grammar='root ::= "a" [b'),
     "params.decoding.grammar", "does not parse"),
    ("grammar with an undefined rule", PROMPT, opts(grammar="start: value"),
     "params.decoding.grammar", 'unknown name: "value"'),
    ("one choice", PROMPT, opts(choices=["only"]), "params.decoding.choice.choices",
     "at least 2 choices"),
]


def run_stream(server: Server, text: str,
               options: GenerateOptions) -> list[pb.GenerationResponse]:
    return list(server.client.stream(text, options, timeout=60))


@pytest.fixture(scope="module")
def reference(server: Server) -> str:
    msgs = run_stream(server, PROMPT, opts(max_new_tokens=MAX_NEW_TOKENS,
                                        min_new_tokens=MAX_NEW_TOKENS))
    return "".join(m.text for m in msgs[1:])


def test_bad_requests_fail_alone_and_a_running_stream_is_unharmed(server: Server,
                                                                  reference: str) -> None:
    """Valid streams run back to back until the last bad request is answered, so one is in
    flight across the bad requests however slowly a loaded machine answers them."""
    first = threading.Event()
    done = threading.Event()
    finished: list[tuple[pb.GenerationResponse | None, str]] = []
    errors: list[grpc.RpcError] = []

    def valid() -> None:
        while not done.is_set():
            parts, last = [], None
            try:
                for m in server.client.stream(PROMPT, opts(max_new_tokens=MAX_NEW_TOKENS,
                                                        min_new_tokens=MAX_NEW_TOKENS),
                                              timeout=60):
                    parts.append(m.text)
                    if m.generated_token_count:
                        first.set()
                    last = m
            except grpc.RpcError as exc:
                errors.append(exc)
                break
            finally:
                first.set()
            finished.append((last, "".join(parts)))

    thread = threading.Thread(target=valid)
    thread.start()
    assert first.wait(30)
    failures = []
    try:
        for name, text, options, field, limit in INVALID:
            try:
                run_stream(server, text, options)
                failures.append(f"{name}: accepted")
                continue
            except grpc.RpcError as exc:
                details = exc.details() or ""
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT \
                        or not details.startswith(field) or limit not in details:
                    failures.append(f"{name}: {exc.code().name} {details!r}")
    finally:
        done.set()
        thread.join(120)
    assert failures == []
    assert errors == []
    assert finished, "no valid stream finished"
    for last, text in finished:
        assert isinstance(last, pb.GenerationResponse)
        assert (last.stop_reason, last.generated_token_count) == (pb.MAX_TOKENS,
                                                                  MAX_NEW_TOKENS)
        assert text == reference


def test_truncation_makes_a_long_prompt_fit(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as err:
        run_stream(server, LONG, opts(max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    msgs = run_stream(server, LONG, opts(max_new_tokens=4, truncate_input_tokens=50))
    assert msgs[0].input_token_count == 50
    assert (msgs[-1].stop_reason, msgs[-1].generated_token_count) == (pb.MAX_TOKENS, 4)


def test_generate_names_the_bad_prompt_and_runs_none(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as err:
        server.client.generate([PROMPT, LONG], opts(max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("requests[1].text")
    with pytest.raises(grpc.RpcError) as err:
        server.client.generate([], opts())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unsupported_features_are_unimplemented(server: Server) -> None:
    stub = server.client.stub
    text = pb.GenerationRequest(text=PROMPT)
    calls = {
        "prefix_id": lambda: list(stub.GenerateStream(
            pb.SingleGenerationRequest(request=text, prefix_id="my-prompt-tuning"))),
        "adapter_id": lambda: stub.Generate(
            pb.BatchedGenerationRequest(requests=[text], adapter_id="my-lora")),
        "adapter_id ": lambda: stub.Tokenize(
            pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=PROMPT)],
                                      adapter_id="my-lora")),
    }
    for field, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, field
        assert (err.value.details() or "").startswith(field.strip()), err.value.details()
        assert "not supported" in (err.value.details() or "")
    # An empty id names nothing and is accepted.
    resp = stub.Generate(pb.BatchedGenerationRequest(
        requests=[text], prefix_id="", params=opts(max_new_tokens=2).to_proto()))
    assert resp.responses[0].generated_token_count == 2


def test_valid_constraints_are_accepted_over_both_rpcs(server: Server) -> None:
    """The constraint is compiled and travels with the request (whether the output obeys it
    is the gpu worker's part, tested there); format=TEXT is no constraint at all."""
    last = run_stream(server, PROMPT, opts(max_new_tokens=8, json_schema=(
        '{"type": "object", "properties": {"n": {"type": "integer"}}}')))[-1]
    assert last.stop_reason in (pb.EOS_TOKEN, pb.MAX_TOKENS)
    responses = server.client.generate([PROMPT, "Colours:"], opts(
        max_new_tokens=4, choices=["red", "green", "blue"]))
    assert [r.stop_reason in (pb.EOS_TOKEN, pb.MAX_TOKENS) for r in responses] == [True, True]
    plain = server.client.generate([PROMPT], opts(max_new_tokens=6, min_new_tokens=6))
    text = server.client.generate([PROMPT], opts(max_new_tokens=6, min_new_tokens=6,
                                                 response_format="text"))
    assert text[0].text == plain[0].text and text[0].generated_token_count == 6
