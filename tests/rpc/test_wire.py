"""Request bytes that do not parse are the client's error (INVALID_ARGUMENT), not INTERNAL."""
from __future__ import annotations

from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.wire import Unparseable, lenient
from tests.fuzz.strategies import inject, string_paths


def test_a_valid_request_parses_as_usual() -> None:
    msg = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="hello"))
    msg.params.stopping.stop_sequences.append("é")
    assert lenient(pb.SingleGenerationRequest)(msg.SerializeToString()) == msg


def test_invalid_utf8_in_any_string_field_is_unparseable_with_a_reason() -> None:
    parse = lenient(pb.SingleGenerationRequest)
    paths = string_paths(pb.SingleGenerationRequest.DESCRIPTOR)
    assert any(p[-1].name == "stop_sequences" for p in paths)
    for path in paths:
        got = parse(inject(path, b"ok\xff"))
        assert isinstance(got, Unparseable), ".".join(f.name for f in path)
        assert got.type_name == "fmaas.SingleGenerationRequest"
        assert got.message.startswith("request: not a valid fmaas.SingleGenerationRequest")
        assert "UTF-8" in got.message


def test_truncated_bytes_are_unparseable() -> None:
    data = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text="x" * 50)]
                                     ).SerializeToString()
    assert isinstance(lenient(pb.BatchedTokenizeRequest)(data[:-3]), Unparseable)
