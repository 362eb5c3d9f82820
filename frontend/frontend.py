"""What the frontend's two APIs share: the engine, the tokenizer, the limits, readiness.

The gRPC service (`rpc/server.py`) and the OpenAI-compatible HTTP API (`openai_api/`) each
validate their own parameters into the same `frontend.validation.ValidatedRequest`, then
tokenize, check the prompt and submit here, so a request means the same thing whichever door
it came in by and both see the same readiness and drain state.  Every log line about a
request carries its correlation id (the client's, or a frontend-made tag when absent).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from tandem_serve.frontend import metrics
from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.frontend.engine_client import EngineClient, EngineError
from tandem_serve.frontend.guided import Compiled, attach, compile_spec
from tandem_serve.frontend.request_traces import RequestTraces, request_facts
from tandem_serve.frontend.validation import Limits, ValidatedRequest
from tandem_serve.guided.service import GuidedCompiler
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.request_params import ImageInput
from tandem_serve.proto.token_messages import OutputDelta
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.frontend")

# Longer texts are rendered (chat templates) on a worker thread: a multi-megabyte prompt would
# otherwise stall the event loop, and with it every other stream, for the whole render.
THREAD_ENCODE_CHARS = 64 << 10
# Longer texts are tokenized on a worker thread, with the GIL released: ~0.26 us a character
# here, so a 1,000-token prompt (~2,000 characters) held every other stream for 0.5-1.4 ms
# on the event loop while it arrived, and a 64k-character one ~17 ms; the hop to the
# thread costs ~60 us.
THREAD_TOKENIZE_CHARS = 1 << 10

_anonymous = itertools.count(1)


class RequestLog(logging.LoggerAdapter):
    """Prefixes every line with the request's correlation id (also a record attribute)."""

    def __init__(self, logger: logging.Logger, cid: str) -> None:
        super().__init__(logger, {"correlation_id": cid})
        self.cid = cid

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        assert self.extra is not None
        kwargs.setdefault("extra", {}).update(self.extra)
        return f"[{self.extra['correlation_id']}] {msg}", kwargs


def served_names(cfg: ServerConfig) -> tuple[str, ...]:
    """The name /v1/models lists first (--served-model-name, else the folder's name), and the
    --model path as given, which clients may send too."""
    folder = os.path.basename(os.path.normpath(cfg.model)) or cfg.model
    return tuple(dict.fromkeys([cfg.served_model_name or folder, cfg.model]))


def request_log(correlation_id: str | None) -> RequestLog:
    # Without one, a tag of our own still tells concurrent requests apart in the log.
    return RequestLog(log, correlation_id or f"anon-{next(_anonymous)}")


@dataclass
class Prepared:
    """One validated, tokenized prompt, ready to submit."""

    req: ValidatedRequest
    text: str
    ids: list[int]
    deadline: float | None  # time.monotonic(); the time limit counts from the arrival
    rid: int  # the engine's request id, known before tokenizing so spans can name it
    arrived: float  # time.monotonic() of the request's arrival
    guided: Compiled | None = None  # the compiled output constraint, if any
    adapter_id: str = ""  # a validated LoRA adapter ("": the base model)
    images: list[ImageInput] = field(default_factory=list)  # a VL model's prompt images
    n: int = 1  # choices asked for with this prompt (the trace's gen_ai.request.n)


class Frontend:
    """The engine client and tokenizer behind every API, and whether they may take work.

    `limits` is set once the gpu worker reported in, `serving` once the warm-up request went
    through (readiness), and `accepting` goes False when the server drains.
    """

    def __init__(self, engine: EngineClient, tok: Tokenizer,
                 adapters: AdapterStore | None = None) -> None:
        self.engine = engine
        self.tok = tok
        self.adapters = adapters  # LoRA adapters (None: no --adapter-cache)
        self.limits: Limits | None = None
        self.unready = "server is still starting"  # why, while `limits` is None
        self.guided: GuidedCompiler | None = None  # set before `limits`
        self.accepting = True
        self.serving = False
        self.traces: RequestTraces | None = None  # --otlp-traces-endpoint

    def ready_limits(self) -> Limits:
        """The limits, or UNAVAILABLE while starting or draining."""
        if self.limits is None:
            raise EngineError("UNAVAILABLE", self.unready)
        if not self.accepting:
            raise EngineError("UNAVAILABLE", "server is shutting down")
        return self.limits

    async def encode(self, text: str, rid: int = -1, add_special_tokens: bool = True
                     ) -> list[int]:
        if len(text) > THREAD_TOKENIZE_CHARS:
            # No span: on its thread it overlaps the event loop's spans, and a lane's spans
            # must nest or be disjoint.  Released, the GIL lets the loop go on streaming.
            return await asyncio.to_thread(self.tok.encode, text, add_special_tokens,
                                           release_gil=True)
        with TRACER.span("tokenize", -1, rid):
            return self.tok.encode(text, add_special_tokens)

    @staticmethod
    def prepared(req: ValidatedRequest, text: str, ids: list[int], rid: int, arrived: float,
                 adapter_id: str = "") -> Prepared:
        deadline = arrived + req.time_limit if req.time_limit else None
        return Prepared(req, text, ids, deadline, rid, arrived, adapter_id=adapter_id)

    async def compile(self, prepared: list[Prepared]) -> None:
        """Compile the constraint the requests share (once, off the event loop) and attach it;
        an EngineError naming the field when it cannot be."""
        spec = prepared[0].req.guided if prepared else None
        if spec is None:
            return
        compiled = await compile_spec(self.guided, spec)
        for p in prepared:
            p.guided = compiled
            attach(p.req.sampling, compiled)

    def generate(self, p: Prepared, name: str) -> AsyncIterator[OutputDelta]:
        """The request's deltas until its last; leaving early aborts it in the engine."""
        if p.adapter_id:
            metrics.ADAPTER_REQUESTS.labels(p.adapter_id).inc()
        if p.images:
            self.engine.attach_images(p.rid, p.images)
        deltas = self.engine.generate(p.ids, p.req.sampling, p.req.options, p.deadline,
                                      name=name, request_id=p.rid, arrived=p.arrived,
                                      guided=p.guided, adapter_id=p.adapter_id)
        if self.traces is None:
            return deltas
        return self.traces.traced(deltas, request_facts(p.rid, p.arrived, len(p.ids),
                                                        p.req.sampling, p.n, name))
