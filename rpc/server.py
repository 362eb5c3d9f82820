"""The gRPC `fmaas.GenerationService`: validate, tokenize, submit, stream the deltas back."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from proto import generation_pb2 as pb
from proto import generation_pb2_grpc as pb_grpc
from proto.messages import FinishReason, OutputDelta
from rpc.engine_client import EngineClient, EngineError
from rpc.tokenizer import Tokenizer
from rpc.validation import (Limits, Request, UnsupportedError, ValidationError, check_prompt,
                            validate_params)

log = logging.getLogger("tandem.frontend")

SERVICE_NAME = "fmaas.GenerationService"


def _correlation_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-correlation-id":
            return str(value)
    return "-"


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, engine: EngineClient, tok: Tokenizer) -> None:
        self.engine = engine
        self.tok = tok
        self.limits: Limits | None = None  # known once the gpu worker reports in
        self.accepting = True

    async def _ready_limits(self, context: grpc.aio.ServicerContext) -> Limits:
        if self.limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still starting")
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        assert self.limits is not None
        return self.limits

    # ------------------------------------------------------------------ helpers

    async def _prepare(self, text: str, params: pb.Parameters,
                       context: grpc.aio.ServicerContext, field: str) -> tuple[Request, list[int]]:
        limits = await self._ready_limits(context)
        try:
            req = validate_params(params, limits)
            if not text:  # the tokenizer would still give [BOS]
                raise ValidationError(field, "must not be empty")
            ids = self.tok.encode(text)
            if req.truncate_input_tokens and len(ids) > req.truncate_input_tokens:
                ids = ids[-req.truncate_input_tokens:]  # TGIS keeps the end of the prompt
            check_prompt(len(ids), req.sampling.min_new_tokens, limits, field)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except UnsupportedError as exc:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        return req, ids

    def _input_details(self, req: Request, text: str, ids: list[int],
                       resp: pb.GenerationResponse) -> None:
        resp.input_token_count = len(ids)
        if req.input_text:
            resp.text = text
        if req.input_tokens:
            resp.input_tokens.extend(pb.TokenInfo(text=self.tok.id_to_token(i)) for i in ids)

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
                info.top_tokens.extend(pb.TokenInfo.TopToken(text=t, logprob=lp)
                                       for t, lp in zip(d.top_texts[j], d.top_logprobs[j]))
            out.append(info)
        return out

    async def _run(self, req: Request, ids: list[int], context: grpc.aio.ServicerContext,
                   cid: str) -> AsyncIterator[OutputDelta]:
        deadline = time.monotonic() + req.time_limit if req.time_limit else None
        try:
            async for d in self.engine.generate(ids, req.sampling, req.options, deadline):
                yield d
        except EngineError as exc:
            log.warning("request %s failed: %s", cid, exc)
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    # ------------------------------------------------------------------ RPCs

    async def GenerateStream(self, request: pb.SingleGenerationRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerationResponse]:
        cid = _correlation_id(context)
        text = request.request.text
        req, ids = await self._prepare(text, request.params, context, "request.text")
        log.info("stream %s: %d prompt tokens, max_new_tokens %d", cid, len(ids),
                 req.sampling.max_new_tokens)
        generated = 0
        first = True
        async for d in self._run(req, ids, context, cid):
            if first:  # only now: a rejection must come before any response
                head = pb.GenerationResponse()
                self._input_details(req, text, ids, head)
                yield head
                first = False
            generated = d.num_generated if d.num_generated >= 0 else generated
            resp = pb.GenerationResponse(generated_token_count=generated, text=d.text,
                                         stop_reason=int(d.finish_reason),
                                         stop_sequence=d.stop_sequence)
            resp.tokens.extend(self._token_infos(d))
            if d.finish_reason != FinishReason.NOT_FINISHED:
                resp.seed = req.seed_returned
            yield resp

    async def _generate_one(self, text: str, params: pb.Parameters,
                            context: grpc.aio.ServicerContext, cid: str,
                            index: int) -> pb.GenerationResponse:
        req, ids = await self._prepare(text, params, context, f"requests[{index}].text")
        resp = pb.GenerationResponse()
        self._input_details(req, text, ids, resp)
        parts: list[str] = [resp.text] if req.input_text else []
        async for d in self._run(req, ids, context, cid):
            parts.append(d.text)
            if d.num_generated >= 0:
                resp.generated_token_count = d.num_generated
            resp.tokens.extend(self._token_infos(d))
            resp.stop_reason = int(d.finish_reason)
            resp.stop_sequence = d.stop_sequence
        resp.text = "".join(parts)
        resp.seed = req.seed_returned
        return resp

    async def Generate(self, request: pb.BatchedGenerationRequest,
                       context: grpc.aio.ServicerContext) -> pb.BatchedGenerationResponse:
        cid = _correlation_id(context)
        if not request.requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "requests: must not be empty")
        # Validate every input before any is submitted, so a bad one wastes no work.
        for i, r in enumerate(request.requests):
            await self._prepare(r.text, request.params, context, f"requests[{i}].text")
        log.info("batch %s: %d requests", cid, len(request.requests))
        results = await asyncio.gather(*(
            self._generate_one(r.text, request.params, context, cid, i)
            for i, r in enumerate(request.requests)))
        return pb.BatchedGenerationResponse(responses=results)

    async def Tokenize(self, request: pb.BatchedTokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.BatchedTokenizeResponse:
        out = pb.BatchedTokenizeResponse()
        for r in request.requests:
            ids, offsets = self.tok.encode_with_offsets(r.text)
            if request.truncate_input_tokens and len(ids) > request.truncate_input_tokens:
                ids = ids[-request.truncate_input_tokens:]
                offsets = offsets[-request.truncate_input_tokens:]
            resp = pb.TokenizeResponse(token_count=len(ids))
            if request.return_tokens:
                resp.tokens.extend(self.tok.id_to_token(i) for i in ids)
            if request.return_offsets:
                resp.offsets.extend(pb.TokenizeResponse.Offset(start=s, end=e)
                                    for s, e in offsets)
            out.responses.append(resp)
        return out

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        limits = await self._ready_limits(context)
        return pb.ModelInfoResponse(model_kind=pb.ModelInfoResponse.DECODER_ONLY,
                                    max_sequence_length=limits.max_model_len,
                                    max_new_tokens=limits.max_new_tokens)
