"""Server reflection, the way grpcurl uses it: list the services, fetch their descriptors, and
call GenerateStream with message classes built only from what reflection returned (no
generated stubs).  Run with `-s` to see a grpcurl-like transcript."""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir))


def list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return [s.name for s in answer.list_services_response.service]


def test_reflection_is_enough_to_call_generate_stream(server: Server) -> None:
    target = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(target) as channel:
        print(f"\n$ grpcurl -plaintext {target} list")
        services = list_services(channel)
        for name in services:
            print(name)
        assert {"fmaas.GenerationService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection", "tandem.admin.Admin"} <= set(services)

        # A descriptor pool filled only from the server's answers.
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName("fmaas.GenerationService")
        print(f"\n$ grpcurl -plaintext {target} describe fmaas.GenerationService")
        print(f"service {service.name} {{")
        for m in service.methods:
            stream = "stream " if m.server_streaming else ""
            print(f"  rpc {m.name} ( .{m.input_type.full_name} ) returns "
                  f"( {stream}.{m.output_type.full_name} );")
        print("}")
        assert [m.name for m in service.methods] == ["Generate", "GenerateStream", "Tokenize",
                                                     "ModelInfo"]

        method = service.methods_by_name["GenerateStream"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        body = {"request": {"text": PROMPT},
                "params": {"stopping": {"maxNewTokens": 5},
                           "response": {"generatedTokens": True, "tokenLogprobs": True}}}
        request = json_format.ParseDict(body, request_cls())
        print(f"\n$ grpcurl -plaintext -d '{json.dumps(body)}' {target} "
              f"fmaas.GenerationService/GenerateStream")
        call = channel.unary_stream(f"/{service.full_name}/{method.name}",
                                    request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        responses = list(call(request, timeout=60))
        for r in responses:
            print(json_format.MessageToJson(r, indent=2, ensure_ascii=False))

        assert responses[0].input_token_count > 0
        assert responses[-1].generated_token_count == 5
        stop_reason = method.output_type.fields_by_name["stop_reason"].enum_type
        assert stop_reason.values_by_number[responses[-1].stop_reason].name == "MAX_TOKENS"
        text = "".join(r.text for r in responses[1:])
        # The same answer as the generated stubs give.
        (expected,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=5))
        assert text == expected.text
        assert sum(len(r.tokens) for r in responses) == 5

        # The admin service is reachable the same way.
        admin = pool.FindServiceByName("tandem.admin.Admin")
        stats_method = admin.methods_by_name["Stats"]
        stats_call = channel.unary_unary(
            f"/{admin.full_name}/Stats",
            request_serializer=message_factory.GetMessageClass(
                stats_method.input_type).SerializeToString,
            response_deserializer=message_factory.GetMessageClass(
                stats_method.output_type).FromString)
        print(f"\n$ grpcurl -plaintext {target} tandem.admin.Admin/Stats")
        stats = stats_call(message_factory.GetMessageClass(stats_method.input_type)(), timeout=10)
        print(json_format.MessageToJson(stats, indent=2, ensure_ascii=False))
        assert stats.num_total_blocks > 0
