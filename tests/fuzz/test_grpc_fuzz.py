"""Fuzzing `fmaas.GenerationService` over a real server (one per module, fast preset).

Requests come from `tests/fuzz/strategies.py`: messages built from the proto's descriptors
(every field, edge values, unknown enum numbers) and raw wire bytes (invalid UTF-8 in any
string field, truncated and random bytes).  The server has every feature the API names
(guided decoding; LoRA adapters from an empty adapter cache, so every adapter or prefix id is
validated and none is found), so every reply must be a success or INVALID_ARGUMENT; never
UNIMPLEMENTED, INTERNAL, UNKNOWN, a dropped connection or a hang.  Afterwards the server
is healthy, every KV block is free, nothing runs or waits, and greedy output equals HF.

Size and seed: `TANDEM_FUZZ_EXAMPLES` (default 200, what `make test` runs) and
`TANDEM_FUZZ_SEED` (default 0); `make fuzz` runs thousands.  `TANDEM_FUZZ_REPORT=FILE`
writes the outcome counts as JSON.
"""
from __future__ import annotations

import json
import os
import pathlib
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings

from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions, make_channel
from tests.e2e.server import Server, running
from tests.fuzz.strategies import METHODS, Call, calls, inject, string_paths
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "200"))
SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "0"))
CALL_TIMEOUT = 120.0  # seconds; a call that takes longer is a hang
# Small caps keep every accepted request short; larger values are rejected, which is
# fuzzed too.
FLAGS = ("--max-new-tokens", "32", "--default-max-new-tokens", "4",
         "--num-scheduler-steps", "4")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example,
                                       HealthCheck.function_scoped_fixture])

OUTCOMES: Counter[tuple[str, str]] = Counter()  # (method, status code) over the whole run
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


@pytest.fixture(scope="module")
def server(fast_model_dir: pathlib.Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    adapters = tmp_path_factory.mktemp("no-adapters")
    yield from running(str(fast_model_dir), *FLAGS, "--adapter-cache", str(adapters))


@pytest.fixture(scope="module")
def channel(server: Server) -> Iterator[grpc.Channel]:
    ch = make_channel(f"127.0.0.1:{server.port}")
    yield ch
    ch.close()


def invoke(channel: grpc.Channel, call: Call) -> tuple[grpc.StatusCode, str, list]:
    """Send the call's bytes as they are; its status, details and response messages."""
    m = call.method
    kind = channel.unary_stream if m.streaming else channel.unary_unary
    # No request serializer: the bytes go out untouched, invalid UTF-8 and all.
    rpc = kind(m.path, request_serializer=None, response_deserializer=m.response.FromString)
    try:
        if m.streaming:
            return grpc.StatusCode.OK, "", list(rpc(call.data, timeout=CALL_TIMEOUT))
        return grpc.StatusCode.OK, "", [rpc(call.data, timeout=CALL_TIMEOUT)]
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []


def check_success(call: Call, replies: list) -> None:
    """A successful generation always says why it ended."""
    if call.method.name == "GenerateStream":
        assert replies, "a stream that succeeded without a single message"
        assert replies[-1].stop_reason != pb.NOT_FINISHED, replies[-1]
    elif call.method.name == "Generate":
        for r in replies[0].responses:
            assert r.stop_reason != pb.NOT_FINISHED, r


@FUZZ
@seed(SEED)
@given(call=calls())
def test_every_request_is_answered_ok_or_invalid_argument(channel: grpc.Channel,
                                                          call: Call) -> None:
    code, details, replies = invoke(channel, call)
    OUTCOMES[(call.method.name, code.name)] += 1
    assert code in ALLOWED, f"{code.name} {details!r} for {call.describe()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details, f"INVALID_ARGUMENT without a message for {call.describe()}"
    else:
        check_success(call, replies)


@pytest.mark.parametrize("method", ["GenerateStream", "Generate", "Tokenize"])
def test_invalid_utf8_is_invalid_argument_not_unknown(channel: grpc.Channel,
                                                      method: str) -> None:
    """Found by fuzzing: grpcio answered UNKNOWN ("Unexpected DecodeError") for a request
    with invalid UTF-8 in a string field (here: a stop sequence, or the prompt)."""
    m = next(x for x in METHODS if x.name == method)
    paths = string_paths(m.request.DESCRIPTOR)
    path = next((p for p in paths if p[-1].name == "stop_sequences"),
                next(p for p in paths if p[-1].name == "text"))
    ok = m.request()
    data = ok.SerializeToString() + inject(path, b"stop\xfe")
    code, details, _ = invoke(channel, Call(m, data, None, "bad-utf8"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"request: not a valid {m.request.DESCRIPTOR.full_name}")
    assert "UTF-8" in details


def test_an_unknown_decoding_method_is_invalid_argument(server: Server) -> None:
    """Found by fuzzing: proto3 enums are open, and method 7 ran as greedy."""
    req = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="hello"))
    req.params.method = 7  # type: ignore[assignment]
    with pytest.raises(grpc.RpcError) as err:
        list(server.client.stub.GenerateStream(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("params.method: unknown decoding method 7")


def test_after_fuzzing_the_server_is_healthy_idle_and_still_equal_to_hf(
        server: Server, fast_model_dir: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    client = server.client
    assert client.is_serving()
    deadline = time.monotonic() + 20
    while True:  # the admin counters lag the scheduler by up to 0.2 s
        stats = client.stats()
        idle = (stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
                and stats.num_waiting == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, f"not idle after fuzzing: {stats}"
    prompt, n = "Once upon a time", 16
    got = "".join(r.text for r in client.stream(
        prompt, GenerateOptions(max_new_tokens=n, min_new_tokens=n)))
    assert got == hf_greedy(fast_model_dir, [(prompt, n)])[0]
    report(capsys)


def report(capsys: pytest.CaptureFixture) -> None:
    """The outcome counts, on the terminal and (TANDEM_FUZZ_REPORT) as JSON."""
    total = sum(OUTCOMES.values())
    by_code = Counter[str]()
    for (_, code), n in OUTCOMES.items():
        by_code[code] += n
    with capsys.disabled():
        print(f"\ngRPC fuzz: {total} requests (seed {SEED}); by status: "
              + ", ".join(f"{c} {n}" for c, n in by_code.most_common()))
    path = os.environ.get("TANDEM_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"seed": SEED, "examples": EXAMPLES, "requests": total,
                       "by_status": dict(by_code),
                       "by_method": {f"{m} {c}": n for (m, c), n in sorted(OUTCOMES.items())}},
                      f, indent=1)
