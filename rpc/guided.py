"""Guided decoding in the gRPC service: compile a request's constraint, or abort with why.

Every failure names the request field the constraint came from: a bad constraint (malformed
regex, unsupported or invalid schema, grammar syntax, too slow to compile) is
INVALID_ARGUMENT; a model whose tokenizer cannot be guided is UNIMPLEMENTED; too many
constraints compiling at once is RESOURCE_EXHAUSTED; no compile worker is UNAVAILABLE.
"""
from __future__ import annotations

import logging
from typing import Any

import grpc

from guided.compile import CompileError
from guided.pool import CompilerUnavailable
from guided.service import CompileBusy, GuidedCompiler, GuidedSettings
from guided.spec import GuidedSpec
from guided.vocab import UnsupportedTokenizer
from proto.config import ServerConfig
from proto.messages import GuidedGrammar, GuidedKind, GuidedTable, SamplingParams

Compiled = GuidedTable | GuidedGrammar


def settings(cfg: ServerConfig, vocab_size: int) -> GuidedSettings:
    return GuidedSettings(model=cfg.model, vocab_size=vocab_size,
                          cache_dir=cfg.guided_cache_dir,
                          compile_timeout=cfg.guided_compile_timeout, log_level=cfg.log_level)


async def compile_or_abort(compiler: GuidedCompiler | None, spec: GuidedSpec,
                           context: grpc.aio.ServicerContext, rlog: logging.LoggerAdapter[Any]
                           ) -> Compiled:
    code, message = grpc.StatusCode.UNAVAILABLE, "server is still starting"
    if compiler is not None:
        try:
            return await compiler.compile(spec)
        except CompileError as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, f"{spec.field}: {e}"
        except UnsupportedTokenizer as e:
            code = grpc.StatusCode.UNIMPLEMENTED
            message = f"{spec.field}: guided decoding is not available for this model: {e}"
        except CompileBusy as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, f"{spec.field}: {e}"
        except CompilerUnavailable as e:
            code, message = grpc.StatusCode.UNAVAILABLE, f"{spec.field}: {e}"
    rlog.info("rejected: %s: %s", code.name, message)
    await context.abort(code, message)
    raise AssertionError("abort returns only by raising")


def attach(sampling: SamplingParams, compiled: Compiled | None) -> None:
    """Name the compiled constraint in the request's sampling params."""
    if isinstance(compiled, GuidedTable):
        sampling.guided_kind, sampling.guided_id = GuidedKind.TABLE, compiled.table_id
    elif isinstance(compiled, GuidedGrammar):
        sampling.guided_kind, sampling.guided_id = GuidedKind.GRAMMAR, compiled.grammar_id
