"""A small Python client for `fmaas.GenerationService`, used by the CLI, tests and benchmarks."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_serve.proto import admin_pb2, admin_pb2_grpc
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.proto import generation_pb2_grpc as pb_grpc

SERVICE_NAME = "fmaas.GenerationService"


@dataclass
class GenerateOptions:
    """Every TGIS parameter as a flat field; None leaves the server default."""

    max_new_tokens: int = 0
    min_new_tokens: int = 0
    sample: bool = False
    temperature: float | None = None
    top_k: int = 0
    top_p: float = 0.0
    typical_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 0.0
    length_penalty: tuple[int, float] | None = None
    stop_sequences: list[str] = field(default_factory=list)
    include_stop_sequence: bool | None = None
    time_limit_millis: int = 0
    truncate_input_tokens: int = 0
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0
    # Guided decoding: at most one of these (the proto's oneof).
    regex: str | None = None
    json_schema: str | None = None  # the schema's JSON text
    grammar: str | None = None  # GBNF (`root ::= ...`) or Lark
    choices: list[str] | None = None
    response_format: str | None = None  # "json" (any JSON object) or "text"

    def to_proto(self) -> pb.Parameters:
        p = pb.Parameters(method=pb.SAMPLE if self.sample else pb.GREEDY,
                          truncate_input_tokens=self.truncate_input_tokens)
        s = p.sampling
        if self.temperature is not None:
            s.temperature = self.temperature
        s.top_k, s.top_p, s.typical_p = self.top_k, self.top_p, self.typical_p
        if self.seed is not None:
            s.seed = self.seed
        st = p.stopping
        st.max_new_tokens, st.min_new_tokens = self.max_new_tokens, self.min_new_tokens
        st.time_limit_millis = self.time_limit_millis
        st.stop_sequences.extend(self.stop_sequences)
        if self.include_stop_sequence is not None:
            st.include_stop_sequence = self.include_stop_sequence
        r = p.response
        r.input_text, r.generated_tokens, r.input_tokens = (
            self.input_text, self.generated_tokens, self.input_tokens)
        r.token_logprobs, r.token_ranks, r.top_n_tokens = (
            self.token_logprobs, self.token_ranks, self.top_n_tokens)
        p.decoding.repetition_penalty = self.repetition_penalty
        if self.length_penalty is not None:
            p.decoding.length_penalty.start_index = self.length_penalty[0]
            p.decoding.length_penalty.decay_factor = self.length_penalty[1]
        self._guided(p.decoding)
        return p

    def _guided(self, d: pb.DecodingParameters) -> None:
        given = [name for name in ("regex", "json_schema", "grammar", "choices",
                                   "response_format") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one guided decoding option, got {', '.join(given)}")
        if self.regex is not None:
            d.regex = self.regex
        elif self.json_schema is not None:
            d.json_schema = self.json_schema
        elif self.grammar is not None:
            d.grammar = self.grammar
        elif self.choices is not None:
            d.choice.SetInParent()
            d.choice.choices.extend(self.choices)
        elif self.response_format is not None:
            d.format = pb.DecodingParameters.ResponseFormat.Value(self.response_format.upper())


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: list[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class _ApiKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call (a server's `--api-key`).  An
    interceptor, not call credentials: gRPC sends those over TLS only."""

    def __init__(self, key: str) -> None:
        self._header = ("authorization", f"Bearer {key}")

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._header],
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Callable[..., Any],
                              details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any],
                               details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)


def make_channel(target: str, tls_ca: str = "", tls_cert: str = "",
                 tls_key: str = "", api_key: str = "") -> grpc.Channel:
    channel = _make_channel(target, tls_ca, tls_cert, tls_key)
    return grpc.intercept_channel(channel, _ApiKey(api_key)) if api_key else channel


def _make_channel(target: str, tls_ca: str, tls_cert: str, tls_key: str) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 64 << 20),
               ("grpc.max_send_message_length", 64 << 20)]
    if not tls_ca:
        return grpc.insecure_channel(target, options=options)

    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
    return grpc.secure_channel(target, creds, options=options)


class TandemClient:
    def __init__(self, target: str = "127.0.0.1:8033", channel: grpc.Channel | None = None,
                 **tls: str) -> None:
        self.channel = channel or make_channel(target, **tls)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def stream(self, text: str, opts: GenerateOptions | None = None,
               metadata: list[tuple[str, str]] | None = None,
               timeout: float | None = None,
               adapter_id: str = "") -> Iterator[pb.GenerationResponse]:
        """One GenerateStream call; `adapter_id`: a LoRA adapter of the server's cache."""
        req = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text),
                                         params=(opts or GenerateOptions()).to_proto())
        if adapter_id:
            req.adapter_id = adapter_id
        return self.stub.GenerateStream(req, metadata=metadata, timeout=timeout)

    def generate(self, texts: list[str], opts: GenerateOptions | None = None,
                 timeout: float | None = None,
                 metadata: list[tuple[str, str]] | None = None,
                 adapter_id: str = "") -> list[pb.GenerationResponse]:
        """One batched Generate call; the responses come in the order of `texts`."""
        req = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in texts],
            params=(opts or GenerateOptions()).to_proto())
        if adapter_id:
            req.adapter_id = adapter_id
        return list(self.stub.Generate(req, timeout=timeout, metadata=metadata).responses)

    def tokenize(self, texts: list[str], tokens: bool = True, offsets: bool = False,
                 truncate: int = 0, adapter_id: str = "") -> list[pb.TokenizeResponse]:
        req = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=t) for t in texts],
                                        return_tokens=tokens, return_offsets=offsets,
                                        truncate_input_tokens=truncate)
        if adapter_id:
            req.adapter_id = adapter_id
        return list(self.stub.Tokenize(req).responses)

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest())

    def stats(self, timeout: float = 5.0) -> admin_pb2.StatsResponse:
        """The server's latest scheduler counters (KV blocks, queues), from `tandem.admin`."""
        return self.admin.Stats(admin_pb2.StatsRequest(), timeout=timeout)

    def is_serving(self, service: str = SERVICE_NAME, timeout: float = 2.0) -> bool:
        try:
            resp = self.health.Check(health_pb2.HealthCheckRequest(service=service),
                                     timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()
