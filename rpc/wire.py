"""Registering `fmaas.GenerationService` so that unparseable requests are the client's error.

gRPC parses a request with the method's deserializer before any servicer code runs; when it
raises (invalid UTF-8 in a proto3 string field, truncated or random bytes), grpcio answers
INTERNAL "Exception deserializing request!", which says the server is broken when the
client sent bytes that are not the message.  Here the deserializer never raises: bytes
that do not parse become an `Unparseable`, and the method answers INVALID_ARGUMENT naming
the message type and protobuf's reason before the servicer sees it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tandem_serve.proto import generation_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


@dataclass(frozen=True)
class Unparseable:
    """Request bytes that are not a valid message of the method's request type."""

    type_name: str
    reason: str

    @property
    def message(self) -> str:
        return (f"request: not a valid {self.type_name} ({self.reason}); string fields must "
                "be UTF-8")


def lenient(cls: type[Message]) -> Callable[[bytes], Message | Unparseable]:
    def parse(data: bytes) -> Message | Unparseable:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Unparseable(cls.DESCRIPTOR.full_name, str(exc) or "malformed bytes")

    return parse


Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def _unary(method: Unary) -> Unary:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unparseable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)

    return handler


def _stream(method: Streaming) -> Streaming:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Unparseable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for response in method(request, context):
            yield response

    return handler


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    """`add_GenerationServiceServicer_to_server`, with lenient request parsing."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            _unary(servicer.Generate), request_deserializer=lenient(pb.BatchedGenerationRequest),
            response_serializer=pb.BatchedGenerationResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            _stream(servicer.GenerateStream),
            request_deserializer=lenient(pb.SingleGenerationRequest),
            response_serializer=pb.GenerationResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            _unary(servicer.Tokenize), request_deserializer=lenient(pb.BatchedTokenizeRequest),
            response_serializer=pb.BatchedTokenizeResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            _unary(servicer.ModelInfo), request_deserializer=lenient(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
