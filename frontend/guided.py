"""Guided decoding in the frontend: compile a request's constraint, or say why not.

Every failure is an `EngineError` naming the request field the constraint came from, so
both APIs answer it their way (gRPC status, HTTP status): a bad constraint (malformed regex,
unsupported or invalid schema, grammar syntax, too slow to compile) is INVALID_ARGUMENT
(400); a model whose tokenizer cannot be guided is UNIMPLEMENTED (400); too many constraints
compiling at once is RESOURCE_EXHAUSTED (429); no compile worker is UNAVAILABLE (503).
"""
from __future__ import annotations

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.guided.compile import CompileError
from tandem_serve.guided.pool import CompilerUnavailable
from tandem_serve.guided.service import CompileBusy, GuidedCompiler, GuidedSettings
from tandem_serve.guided.spec import GuidedSpec
from tandem_serve.guided.vocab import UnsupportedTokenizer
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import GuidedKind, SamplingParams

Compiled = GuidedTable | GuidedGrammar


def settings(cfg: ServerConfig, vocab_size: int) -> GuidedSettings:
    return GuidedSettings(model=cfg.model, vocab_size=vocab_size,
                          cache_dir=cfg.guided_cache_dir,
                          compile_timeout=cfg.guided_compile_timeout, log_level=cfg.log_level)


async def compile_spec(compiler: GuidedCompiler | None, spec: GuidedSpec) -> Compiled:
    if compiler is None:
        raise EngineError("UNAVAILABLE", "server is still starting")
    try:
        return await compiler.compile(spec)
    except CompileError as e:
        raise EngineError("INVALID_ARGUMENT", f"{spec.field}: {e}") from None
    except UnsupportedTokenizer as e:
        raise EngineError("UNIMPLEMENTED", f"{spec.field}: guided decoding is not available "
                                           f"for this model: {e}") from None
    except CompileBusy as e:
        raise EngineError("RESOURCE_EXHAUSTED", f"{spec.field}: {e}") from None
    except CompilerUnavailable as e:
        raise EngineError("UNAVAILABLE", f"{spec.field}: {e}") from None


def attach(sampling: SamplingParams, compiled: Compiled | None) -> None:
    """Name the compiled constraint in the request's sampling params."""
    if isinstance(compiled, GuidedTable):
        sampling.guided_kind, sampling.guided_id = GuidedKind.TABLE, compiled.table_id
    elif isinstance(compiled, GuidedGrammar):
        sampling.guided_kind, sampling.guided_id = GuidedKind.GRAMMAR, compiled.grammar_id
