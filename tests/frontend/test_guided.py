"""`frontend.guided`: each way a constraint can fail becomes the status a client expects."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.guided import attach, compile_spec
from tandem_serve.guided.compile import CompileError
from tandem_serve.guided.pool import CompilerUnavailable, CompileTimeout
from tandem_serve.guided.service import CompileBusy
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.guided.vocab import UnsupportedTokenizer
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import GuidedKind, SamplingParams
from tandem_serve.rpc.client import GenerateOptions

SPEC = GuidedSpec(SpecKind.REGEX, "(", field="params.decoding.regex")
TABLE = GuidedTable("t1", np.zeros((2, 1), np.int32), np.zeros(4, np.int32))


class FakeCompiler:
    def __init__(self, outcome: BaseException | GuidedTable) -> None:
        self.outcome = outcome

    async def compile(self, spec: GuidedSpec) -> GuidedTable:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def outcome_of(compiler: object) -> tuple[grpc.StatusCode, str]:
    """The gRPC status the servicer answers (it aborts with the EngineError's code)."""
    with pytest.raises(EngineError) as err:
        asyncio.run(compile_spec(compiler, SPEC))  # type: ignore[arg-type]
    return getattr(grpc.StatusCode, err.value.code), str(err.value)


@pytest.mark.parametrize("error, code, text", [
    (CompileError("invalid regular expression: unclosed group"),
     grpc.StatusCode.INVALID_ARGUMENT, "params.decoding.regex: invalid regular expression"),
    (CompileTimeout("compiling it took longer than the 30 s limit"),
     grpc.StatusCode.INVALID_ARGUMENT, "params.decoding.regex: compiling it took longer"),
    (UnsupportedTokenizer("needs a byte-level BPE"), grpc.StatusCode.UNIMPLEMENTED,
     "params.decoding.regex: guided decoding is not available for this model: needs"),
    (CompileBusy("16 constraints are compiling"), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "params.decoding.regex: 16 constraints"),
    (CompilerUnavailable("the server is shutting down"), grpc.StatusCode.UNAVAILABLE,
     "shutting down"),
])
def test_each_failure_has_its_status_and_names_the_field(
        error: Exception, code: grpc.StatusCode, text: str) -> None:
    got_code, details = outcome_of(FakeCompiler(error))
    assert got_code == code
    assert details.startswith(text) if code != grpc.StatusCode.UNAVAILABLE else text in details


def test_before_the_compiler_exists_the_server_is_starting() -> None:
    assert outcome_of(None) == (grpc.StatusCode.UNAVAILABLE, "server is still starting")


def test_a_compiled_constraint_is_named_in_the_sampling_params() -> None:
    compiled = asyncio.run(compile_spec(FakeCompiler(TABLE), SPEC))  # type: ignore[arg-type]
    s = SamplingParams()
    attach(s, compiled)
    assert (s.guided_kind, s.guided_id) == (GuidedKind.TABLE, "t1")
    attach(s, GuidedGrammar("g1", "start: /a/"))
    assert (s.guided_kind, s.guided_id) == (GuidedKind.GRAMMAR, "g1")


def test_client_options_fill_the_oneof() -> None:
    d = GenerateOptions(choices=["a", "b"]).to_proto().decoding
    assert d.WhichOneof("guided") == "choice" and list(d.choice.choices) == ["a", "b"]
    d = GenerateOptions(response_format="json").to_proto().decoding
    assert d.WhichOneof("guided") == "format" and d.format == d.JSON
    assert GenerateOptions(regex="x").to_proto().decoding.regex == "x"
    assert GenerateOptions().to_proto().decoding.WhichOneof("guided") is None
    with pytest.raises(ValueError, match="at most one"):
        GenerateOptions(regex="x", grammar="y").to_proto()
