"""The gRPC `fmaas.GenerationService`: validate, tokenize, submit, stream the deltas back.

Also the read-only `tandem.admin.Admin` service (the scheduler's latest counters).  Every log
line about a request carries its `x-correlation-id` (or a frontend-made tag when absent).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any, cast

import grpc

from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.frontend.engine_client import EngineClient, EngineError, ProfileBusy
from tandem_serve.frontend.frontend import (
    THREAD_TOKENIZE_CHARS,
    Frontend,
    Prepared,
    RequestLog,
    request_log,
)
from tandem_serve.frontend.validation import Limits, ValidationError, check_prompt, shown
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto import admin_pb2, admin_pb2_grpc
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.proto import generation_pb2_grpc as pb_grpc
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta
from tandem_serve.rpc.params import UnsupportedError, check_unsupported, validate_params

SERVICE_NAME = "fmaas.GenerationService"
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


def _correlation_id(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "x-correlation-id" and value:
            return str(value)
    return None


def _request_log(context: grpc.aio.ServicerContext) -> RequestLog:
    return request_log(_correlation_id(context))


def _stop_reason(reason: FinishReason) -> pb.StopReason:
    return cast(pb.StopReason, int(reason))  # the numbers are the same by construction


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.engine = frontend.engine
        self.tok = frontend.tok
        # None: no --adapter-cache, adapter ids are unsupported
        self.adapters: AdapterStore | None = frontend.adapters

    async def _ready_limits(self, context: grpc.aio.ServicerContext) -> Limits:
        try:
            return self.frontend.ready_limits()
        except EngineError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise  # abort raises; this only tells the type checker

    # ------------------------------------------------------------------ helpers

    async def _adapter_of(self, request: Any, context: grpc.aio.ServicerContext,
                          rlog: RequestLog) -> str:
        """The request's validated LoRA adapter ("" for none): `adapter_id`, else the older
        name for the same lookup, `prefix_id`.  Without an adapter cache both are
        UNIMPLEMENTED; an adapter we cannot serve is INVALID_ARGUMENT."""
        try:
            if self.adapters is None:
                check_unsupported(request)
                return ""
            for name in ("adapter_id", "prefix_id"):
                if request.HasField(name) and getattr(request, name):
                    return self.adapters.resolve(getattr(request, name), name).adapter_id
        except UnsupportedError as exc:
            rlog.info("rejected: UNIMPLEMENTED: %s", exc)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        except ValidationError as exc:
            rlog.info("rejected: INVALID_ARGUMENT: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return ""

    async def _prepare(self, text: str, params: pb.Parameters,
                       context: grpc.aio.ServicerContext, field: str, arrived: float,
                       rlog: RequestLog, adapter_id: str = "") -> Prepared:
        limits = await self._ready_limits(context)
        rid = self.engine.new_request_id()
        try:
            # Spans end before every await: other requests' spans run in between.
            with TRACER.span("validate", -1, rid):
                req = validate_params(params, limits)
                if not text:  # the tokenizer would still give [BOS]
                    raise ValidationError(field, "must not be empty")
            ids = await self.frontend.encode(text, rid)
            with TRACER.span("validate", -1, rid):
                if req.truncate_input_tokens and len(ids) > req.truncate_input_tokens:
                    ids = ids[-req.truncate_input_tokens:]  # TGIS keeps the end of the prompt
                check_prompt(len(ids), req.sampling.min_new_tokens, limits, field)
        except ValidationError as exc:
            rlog.info("rejected: INVALID_ARGUMENT: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except UnsupportedError as exc:
            rlog.info("rejected: UNIMPLEMENTED: %s", exc)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        return self.frontend.prepared(req, text, ids, rid, arrived, adapter_id)

    def _input_details(self, p: Prepared, first: OutputDelta | None,
                       resp: pb.GenerationResponse) -> None:
        """input_token_count, and the input text / input tokens when asked.

        The prompt's logprobs, ranks and alternatives come on the request's first delta
        (from the postproc worker, out of the gpu worker's prefill); position 0 has none.
        """
        req = p.req
        resp.input_token_count = len(p.ids)
        if req.input_text:
            resp.text = p.text
        if not req.input_tokens:
            return
        lps = first.prompt_logprobs if first is not None else None
        ranks = first.prompt_ranks if first is not None else None
        top_texts = first.prompt_top_texts if first is not None else None
        top_lps = first.prompt_top_logprobs if first is not None else None
        for j, token_id in enumerate(p.ids):
            info = resp.input_tokens.add(text=self.tok.id_to_token(token_id))
            if req.input_logprobs and lps is not None and j < len(lps):
                info.logprob = lps[j]
            if req.input_ranks and ranks is not None and j < len(ranks):
                info.rank = ranks[j]
            if req.input_top_n and top_texts is not None and top_lps is not None \
                    and j < len(top_texts):
                for text, lp in list(zip(top_texts[j], top_lps[j], strict=True))[
                        :req.input_top_n]:
                    info.top_tokens.add(text=text, logprob=lp)

    @staticmethod
    def _token_infos(d: OutputDelta) -> list[pb.TokenInfo]:
        if d.token_texts is None:
            return []
        out = []
        for j, text in enumerate(d.token_texts):
            info = pb.TokenInfo(text=text)
            if d.logprobs is not None:
                info.logprob = d.logprobs[j]
            if d.ranks is not None:
                info.rank = d.ranks[j]
            if d.top_texts is not None and d.top_logprobs is not None:
                info.top_tokens.extend(
                    pb.TokenInfo.TopToken(text=t, logprob=lp)
                    for t, lp in zip(d.top_texts[j], d.top_logprobs[j], strict=True))
            out.append(info)
        return out

    async def _compile(self, prepared: list[Prepared], context: grpc.aio.ServicerContext,
                       rlog: RequestLog) -> None:
        """Compile the constraint the requests share, or abort naming the field."""
        try:
            await self.frontend.compile(prepared)
        except EngineError as exc:
            rlog.info("rejected: %s: %s", exc.code, exc)
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    def _deltas(self, p: Prepared, rlog: RequestLog) -> AsyncIterator[OutputDelta]:
        return self.frontend.generate(p, rlog.cid)

    @staticmethod
    async def _abort_engine_error(context: grpc.aio.ServicerContext, rlog: RequestLog,
                                  exc: EngineError) -> None:
        rlog.warning("failed: %s: %s", exc.code, exc)
        await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    # ------------------------------------------------------------------ RPCs

    async def GenerateStream(self, request: pb.SingleGenerationRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerationResponse]:
        arrived = time.monotonic()
        rlog = _request_log(context)
        adapter_id = await self._adapter_of(request, context, rlog)
        p = await self._prepare(request.request.text, request.params, context, "request.text",
                                arrived, rlog, adapter_id)
        await self._compile([p], context, rlog)
        rlog.info("stream: %d prompt tokens, max_new_tokens %d, %s%s", len(p.ids),
                  p.req.sampling.max_new_tokens,
                  "greedy" if p.req.sampling.greedy else f"seed {p.req.sampling.seed}",
                  f", adapter {adapter_id}" if adapter_id else "")
        generated = 0
        first = True
        reason = FinishReason.NOT_FINISHED
        try:
            async for d in self._deltas(p, rlog):
                if first:  # only now: a rejection must come before any response
                    with TRACER.span("stream_write", -1, p.rid):
                        head = pb.GenerationResponse()
                        self._input_details(p, d, head)
                    yield head
                    first = False
                generated = d.num_generated if d.num_generated >= 0 else generated
                reason = d.finish_reason
                with TRACER.span("stream_write", -1, p.rid):
                    resp = self._stream_response(p, d, generated)
                yield resp
        except EngineError as exc:
            await self._abort_engine_error(context, rlog, exc)
        except asyncio.CancelledError:
            rlog.info("stream cancelled by the client after %d tokens", generated)
            raise
        rlog.info("stream done: %d tokens, %s, %.3f s", generated, reason.name,
                  time.monotonic() - arrived)

    def _stream_response(self, p: Prepared, d: OutputDelta,
                         generated: int) -> pb.GenerationResponse:
        resp = pb.GenerationResponse(generated_token_count=generated, text=d.text,
                                     stop_reason=_stop_reason(d.finish_reason),
                                     stop_sequence=d.stop_sequence)
        resp.tokens.extend(self._token_infos(d))
        if d.finish_reason != FinishReason.NOT_FINISHED:
            resp.seed = p.req.seed_returned
        return resp

    async def _generate_one(self, p: Prepared, rlog: RequestLog) -> pb.GenerationResponse:
        resp = pb.GenerationResponse()
        parts: list[str] = []
        first = True
        async for d in self._deltas(p, rlog):
            # The batched RPC writes once at the end; each delta goes into its response here.
            with TRACER.span("stream_write", -1, p.rid):
                if first:
                    self._input_details(p, d, resp)
                    parts.append(resp.text)  # the input text when asked, else ""
                    first = False
                parts.append(d.text)
                if d.num_generated >= 0:
                    resp.generated_token_count = d.num_generated
                resp.tokens.extend(self._token_infos(d))
                resp.stop_reason = _stop_reason(d.finish_reason)
                resp.stop_sequence = d.stop_sequence
        resp.text = "".join(parts)
        resp.seed = p.req.seed_returned
        return resp

    async def Generate(self, request: pb.BatchedGenerationRequest,
                       context: grpc.aio.ServicerContext) -> pb.BatchedGenerationResponse:
        arrived = time.monotonic()
        rlog = _request_log(context)
        adapter_id = await self._adapter_of(request, context, rlog)
        if not request.requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "requests: must not be empty")
        # Every input is validated before any is submitted, so a bad one wastes no work.
        prepared = [await self._prepare(r.text, request.params, context, f"requests[{i}].text",
                                        arrived, rlog, adapter_id)
                    for i, r in enumerate(request.requests)]
        await self._compile(prepared, context, rlog)
        rlog.info("batch: %d requests, %d prompt tokens", len(prepared),
                  sum(len(p.ids) for p in prepared))
        tasks = [asyncio.ensure_future(self._generate_one(p, rlog)) for p in prepared]
        try:
            # A cancelled call cancels the gather, which cancels (and so aborts) every task.
            results = await asyncio.gather(*tasks)
        except EngineError as exc:
            for t in tasks:  # the others would run on for an answer nobody gets
                t.cancel()
            await self._abort_engine_error(context, rlog, exc)
        except asyncio.CancelledError:
            rlog.info("batch cancelled by the client")
            raise
        rlog.info("batch done: %d tokens, %s, %.3f s",
                  sum(r.generated_token_count for r in results),
                  " ".join(pb.StopReason.Name(r.stop_reason) for r in results),
                  time.monotonic() - arrived)
        return pb.BatchedGenerationResponse(responses=results)

    async def Tokenize(self, request: pb.BatchedTokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.BatchedTokenizeResponse:
        # An adapter is validated like for generation; it tokenizes with the base model's
        # tokenizer (as vLLM does), since adapters with new tokens are not served.
        await self._adapter_of(request, context, _request_log(context))
        out = pb.BatchedTokenizeResponse()
        for r in request.requests:
            if len(r.text) > THREAD_TOKENIZE_CHARS:
                ids, offsets = await asyncio.to_thread(self.tok.encode_with_offsets, r.text,
                                                       release_gil=True)
            else:
                ids, offsets = self.tok.encode_with_offsets(r.text)
            if request.truncate_input_tokens and len(ids) > request.truncate_input_tokens:
                # The same end-keeping truncation as generation applies to its prompts.
                ids = ids[-request.truncate_input_tokens:]
                offsets = offsets[-request.truncate_input_tokens:]
            resp = out.responses.add(token_count=len(ids))
            if request.return_tokens:
                resp.tokens.extend(self.tok.id_to_token(i) for i in ids)
            if request.return_offsets:
                resp.offsets.extend(pb.TokenizeResponse.Offset(start=s, end=e)
                                    for s, e in offsets)
        return out

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        limits = await self._ready_limits(context)
        stats = self.engine.stats
        return pb.ModelInfoResponse(model_kind=pb.ModelInfoResponse.DECODER_ONLY,
                                    max_sequence_length=limits.max_model_len,
                                    max_new_tokens=limits.max_new_tokens,
                                    loaded_adapters=stats.loaded_adapters if stats else [])


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Read-only: the scheduler's latest counters, as the frontend last received them."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def Stats(self, request: admin_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.StatsResponse:
        stats = self.engine.stats
        if stats is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "no statistics yet: the scheduler has not reported")
        assert stats is not None
        # Only the counters: per-report lists (queue times) feed the metrics, not this view.
        fields = admin_pb2.StatsResponse.DESCRIPTOR.fields_by_name
        return admin_pb2.StatsResponse(**{k: v for k, v in asdict(stats).items() if k in fields})

    async def Profile(self, request: admin_pb2.ProfileRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.ProfileResponse:
        duration, path = request.duration_s, request.torch_trace_path
        if not 0 < duration <= 600 or math.isnan(duration):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duration_s: must be in (0, 600], got {duration}")
        if path and not os.path.isabs(path):  # the gpu worker's working folder is not ours
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"torch_trace_path: must be absolute, got {shown(path)}")
        try:
            profiles = await self.engine.profile(duration, request.plans, path)
        except ProfileBusy as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "not every process sent its profile back")
        worker = next((p for p in profiles if p["role"] == "gpu-worker"), {})
        return admin_pb2.ProfileResponse(
            profiles_json=json.dumps(profiles).encode(), plans_recorded=worker.get("plans", 0),
            torch_trace_path=worker.get("torch_trace", ""),
            torch_trace_error=worker.get("torch_error", ""))


def add_admin_service(server: grpc.aio.Server, engine: EngineClient) -> None:
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), server)
