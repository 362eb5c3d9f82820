"""Completions and chat completions on `frontend.frontend.Frontend`: validate, build the prompts,
submit one engine request per choice, answer JSON or server-sent events.

Errors come as HTTP statuses whenever they can: nothing is sent until every choice has its
first delta, so a rejection (admission control: 429; starting, draining: 503) is a status,
not a broken stream. A client that goes away cancels its engine requests (their KV blocks
come back): a stream through starlette's disconnect watch, a JSON answer through our own.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any, TypeVar

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.frontend import THREAD_ENCODE_CHARS, Frontend, RequestLog, request_log
from tandem_serve.frontend.media.fetch import MediaPolicy
from tandem_serve.frontend.media.images import ImageError, ImageRef, Images
from tandem_serve.frontend.validation import Limits, ValidationError
from tandem_serve.openai_api.agents.chat_plan import Agents
from tandem_serve.openai_api.agents.message import Output
from tandem_serve.openai_api.agents.tools import AgentSettings
from tandem_serve.openai_api.chat import params as P
from tandem_serve.openai_api.chat.chat_template import ChatTemplate, TemplateError
from tandem_serve.openai_api.chat.content import parse_content
from tandem_serve.openai_api.chat.logprobs import TokenPieces
from tandem_serve.openai_api.chat.shapes import ChatShape, Choice, CompletionShape, Reply, usage
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.models import Models, Target
from tandem_serve.openai_api.protocol import ChatCompletionRequest, CommonRequest, CompletionRequest
from tandem_serve.proto.request_params import ImageInput
from tandem_serve.proto.token_messages import OutputDelta

T = TypeVar("T")
Shape = CompletionShape | ChatShape
_END = object()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Job:
    """A request submitted, every choice started: its choices and their deltas."""

    rlog: RequestLog
    arrived: float
    target: Target
    choices: list[Choice]
    deltas: Deltas
    prompt_tokens: int


@dataclass
class Prompt:
    text: str  # what echo repeats
    ids: list[int]
    field: str  # the parameter that gave it, for errors
    images: list[ImageInput] = dataclass_field(default_factory=list)  # placeholders' images


class ClientGone(Exception):
    pass


class Deltas:
    """Every choice's deltas as (choice index, delta), in arrival order; an EngineError of any
    choice raises. One choice is read directly; several through one task each."""

    def __init__(self, gens: list[AsyncIterator[OutputDelta]]) -> None:
        self._gens = gens
        # Bounded: a client reading slower than tokens come makes the pumps wait, and the
        # engine client then folds the deltas of each choice (as it does for one choice).
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(4 * len(gens))
        self._tasks: list[asyncio.Task[None]] = []
        self._ready: list[tuple[int, OutputDelta]] = []
        self._open = len(gens)

    async def _pump(self, i: int, gen: AsyncIterator[OutputDelta]) -> None:
        try:
            async for d in gen:
                await self._queue.put((i, d))
            await self._queue.put((i, _END))
        except EngineError as exc:
            await self._queue.put((i, exc))

    async def start(self) -> None:
        """Wait for every choice's first delta: errors come before the response starts."""
        if len(self._gens) == 1:
            try:
                self._ready.append((0, await self._gens[0].__anext__()))
            except StopAsyncIteration:  # cannot happen (a request ends with a delta); be safe
                pass
            return
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self._gens)]
        started: set[int] = set()
        while len(started) < len(self._gens):
            item = await self._take()
            if item is not None:
                started.add(item[0])
                self._ready.append(item)

    async def _take(self) -> tuple[int, OutputDelta] | None:
        i, item = await self._queue.get()
        if isinstance(item, EngineError):
            raise item
        if item is _END:
            self._open -= 1
            return None
        return i, item

    async def __aiter__(self) -> AsyncIterator[tuple[int, OutputDelta]]:
        ready, self._ready = self._ready, []
        for item in ready:
            yield item
        if len(self._gens) == 1:
            async for d in self._gens[0]:
                yield 0, d
            return
        while self._open:
            got = await self._take()
            if got is not None:
                yield got

    async def aclose(self) -> None:
        """Cancel what still runs: each engine request's generator aborts it."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        elif self._gens:
            await self._gens[0].aclose()  # type: ignore[attr-defined]


async def _disconnected(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: HTTPRequest, work: Awaitable[T]) -> T:
    """`work`, cancelled (and ClientGone raised) when the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Serving:
    """The two endpoints' logic; `app` binds it to routes."""

    def __init__(self, frontend: Frontend, model_names: tuple[str, ...],
                 chat_template: ChatTemplate | None, agents: AgentSettings | None = None,
                 images: Images | None = None) -> None:
        self.frontend = frontend
        # Image parts (`frontend.media.images`); without one, images are refused as on a text model.
        self.images = images or Images(MediaPolicy(), None)
        # The base model's names (the first is the one /v1/models lists) and its adapters.
        self.models = Models(model_names, frontend.adapters, int(time.time()))
        self.chat_template = chat_template
        self.pieces = TokenPieces(frontend.tok)
        self.agents = Agents(agents)

    # ------------------------------------------------------------------ prompts

    async def completion_prompts(self, body: CompletionRequest, limits: Limits) -> list[Prompt]:
        prompt = body.prompt
        raw: list[tuple[str | list[int], str]]
        if isinstance(prompt, str):
            raw = [(prompt, "prompt")]
        elif prompt and all(isinstance(x, int) for x in prompt):
            raw = [(list(prompt), "prompt")]  # type: ignore[arg-type]
        else:
            raw = [(x, f"prompt[{i}]") for i, x in enumerate(prompt)]  # type: ignore[misc]
        if not raw:
            raise ValidationError("prompt", "must not be empty")
        out = []
        for value, field in raw:
            if isinstance(value, str):
                if not value:  # the tokenizer would still give [BOS]
                    raise ValidationError(field, "must not be empty")
                out.append(Prompt(value, await self.frontend.encode(value), field))
                continue
            for j, t in enumerate(value):
                if not 0 <= t < limits.vocab_size:
                    raise ValidationError(f"{field}[{j}]", f"token id must be in [0, "
                                                           f"{limits.vocab_size}), got {t}")
            out.append(Prompt(self.frontend.tok.decode(value), list(value), field))
        return out

    async def chat_prompt(self, body: ChatCompletionRequest,
                          tools: list[dict[str, Any]] | None = None) -> Prompt:
        if self.chat_template is None:
            raise ValidationError("messages", "this model has no chat template (no "
                                              "chat_template.jinja or tokenizer_config.json "
                                              "chat_template); use /v1/completions")
        refs: list[ImageRef] = []
        messages = self.agents.messages([_message(i, m.model_dump(exclude_none=True), refs)
                                         for i, m in enumerate(body.messages)])
        template = self.chat_template
        processed = await self.images.prepare(refs)  # before rendering: refusals first

        def render() -> str:
            try:
                return template.render(
                    messages, add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message, tools=tools,
                    kwargs=body.chat_template_kwargs)
            except TemplateError as exc:
                raise ValidationError("messages", str(exc)) from None

        size = sum(len(str(m.get("content", ""))) for m in messages)
        text = await asyncio.to_thread(render) if size > THREAD_ENCODE_CHARS else render()
        if not processed:
            return Prompt(text, await self.frontend.encode(text, add_special_tokens=False),
                          "messages")
        pre = self.images.preprocessor
        assert pre is not None
        try:
            ids = await self.frontend.encode(pre.expand_text(text, len(processed)),
                                             add_special_tokens=False)
            ids, images = pre.expand(ids, processed)
        except ImageError as exc:
            raise ValidationError("messages", str(exc)) from None
        return Prompt(text, ids, "messages", images)

    # ------------------------------------------------------------------ endpoints

    async def create(self, request: HTTPRequest, body: CommonRequest) -> Response:
        job = await self.begin(request, body)
        if isinstance(job, Response):
            return job
        chat = isinstance(body, ChatCompletionRequest)
        opts = body.stream_options
        reply = Reply(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                      created=int(time.time()), model=job.target.name,
                      include_usage=bool(body.stream and opts and opts.include_usage),
                      continuous_usage=bool(body.stream and opts and opts.continuous_usage_stats),
                      return_token_ids=body.return_token_ids)
        shape: Shape = ChatShape(reply, self.pieces) if chat else CompletionShape(reply,
                                                                                  self.pieces)
        deltas, choices, rlog = job.deltas, job.choices, job.rlog
        if body.stream:
            return StreamingResponse(
                self._sse(deltas, choices, shape, job.prompt_tokens, rlog, job.arrived),
                media_type="text/event-stream", headers=SSE_HEADERS)
        if not await self.collect(request, job, lambda i, d: shape.add(choices[i], d)):
            return Response(status_code=499)
        use = usage(job.prompt_tokens, sum(c.generated for c in choices))
        return JSONResponse(shape.response(choices, use))

    async def begin(self, request: HTTPRequest, body: CommonRequest) -> Job | Response:
        """Validate, build the prompts, compile the constraint and submit: the job once every
        choice has its first delta, or the response that says why not (an error raises
        ApiError; a client gone before the first token gets 499)."""
        arrived = time.monotonic()
        rlog = request_log(request.headers.get("x-correlation-id")
                           or request.headers.get("x-request-id"))
        chat = isinstance(body, ChatCompletionRequest)
        target = self.models.resolve(body.model)
        try:
            limits = self.frontend.ready_limits()
            params = P.validate(body, limits)
            output = None
            if isinstance(body, ChatCompletionRequest):
                plan = self.agents.plan(body, params.guided)
                prompts = [await self.chat_prompt(body, plan.tools.tools)]
                output = self.agents.output(plan, prompts[0].text)
                params.guided = self.agents.guided(plan, output)
                self.agents.keep_special_tokens(body, output, params.req.options, tuple(
                    self.frontend.tok.decode([i], skip_special_tokens=False)
                    for i in limits.eos_token_ids))
            else:
                assert isinstance(body, CompletionRequest)
                prompts = await self.completion_prompts(body, limits)
            P.route_guided(params.req, params.guided)
            choices = self._choices(params, prompts, limits, arrived, target.adapter_id,
                                    echo=isinstance(body, CompletionRequest) and body.echo,
                                    output=output)
        except ValidationError as exc:
            rlog.info("rejected: 400: %s", exc)
            raise ApiError.bad_parameter(exc) from None
        except EngineError as exc:
            raise ApiError.from_engine(exc) from None
        try:  # the constraint the choices share, compiled once off the event loop
            await self.frontend.compile([c.p for c in choices])
        except EngineError as exc:
            rlog.info("rejected: %s: %s", exc.code, exc)
            raise ApiError.from_engine(exc, params.guided.field if params.guided else None
                                       ) from None
        rlog.info("%s%s: %d choices, %d prompt tokens, max_tokens %d%s%s",
                  "chat" if chat else "completion", " stream" if body.stream else "",
                  len(choices), sum(len(p.ids) for p in prompts),
                  choices[0].p.req.sampling.max_new_tokens,
                  f", adapter {target.adapter_id}" if target.adapter_id else "",
                  f", user {body.user!r}" if body.user else "")
        deltas = Deltas([self.frontend.generate(c.p, rlog.cid) for c in choices])
        try:
            await unless_disconnected(request, deltas.start())
        except ClientGone:
            await deltas.aclose()
            rlog.info("client went away before the first token")
            return Response(status_code=499)
        except EngineError as exc:
            await deltas.aclose()
            rlog.warning("failed: %s: %s", exc.code, exc)
            raise ApiError.from_engine(exc) from None
        return Job(rlog, arrived, target, choices, deltas, sum(len(p.ids) for p in prompts))

    async def collect(self, request: HTTPRequest, job: Job,
                      add: Callable[[int, OutputDelta], None]) -> bool:
        """Every delta of a job answered as one JSON body; False if the client went away."""
        try:
            await unless_disconnected(request, _each(job.deltas, add))
        except ClientGone:
            job.rlog.info("client went away; request cancelled")
            return False
        except EngineError as exc:
            job.rlog.warning("failed: %s: %s", exc.code, exc)
            raise ApiError.from_engine(exc) from None
        finally:
            await job.deltas.aclose()
        self._log_done(job.rlog, job.choices, job.arrived)
        return True

    async def collect_text(self, request: HTTPRequest, job: Job) -> str | None:
        """A one-choice job's whole text (its choice updated as the deltas come), as the
        Responses and Messages APIs answer without streaming; None if the client went away."""
        c = job.choices[0]
        parts: list[str] = []

        def add(i: int, d: OutputDelta) -> None:
            c.update(d)
            parts.append(d.text)

        return "".join(parts) if await self.collect(request, job, add) else None

    def _choices(self, params: P.Params, prompts: list[Prompt], limits: Limits,
                 arrived: float, adapter_id: str, echo: bool, output: Output | None = None
                 ) -> list[Choice]:
        out: list[Choice] = []
        eos = frozenset(limits.eos_token_ids)
        for i, prompt in enumerate(prompts):
            req = P.for_prompt(params, len(prompt.ids), limits, prompt.field)
            for j in range(params.n):
                sampling = replace(req.sampling, seed=P.choice_seed(params, j))
                p = self.frontend.prepared(replace(req, sampling=sampling), prompt.text,
                                           prompt.ids, self.frontend.engine.new_request_id(),
                                           arrived, adapter_id)
                p.images = prompt.images
                p.n = params.n
                out.append(Choice(len(out), i, p, prompt.text, echo=echo, eos_ids=eos,
                                  output=output,
                                  message=output.stream() if output is not None else None))
        return out

    async def _sse(self, deltas: Deltas, choices: list[Choice], shape: Shape,
                   prompt_tokens: int, rlog: RequestLog, arrived: float
                   ) -> AsyncIterator[bytes]:
        reply = shape.reply
        per_prompt = {c.prompt_index: len(c.p.ids) for c in choices}
        try:
            async for i, d in deltas:
                c = choices[i]
                chunks = shape.chunks(c, d)
                if not chunks:
                    continue
                for chunk in chunks:
                    if reply.continuous_usage:
                        chunk["usage"] = usage(per_prompt[c.prompt_index], c.generated)
                    elif reply.include_usage:
                        chunk["usage"] = None
                yield b"".join(b"data: " + _json(chunk) + b"\n\n"
                               for chunk in chunks)
            if reply.include_usage:
                last = {"id": reply.id, "object": chunks_object(shape),
                        "created": reply.created, "model": reply.model, "choices": [],
                        "usage": usage(prompt_tokens, sum(c.generated for c in choices))}
                yield b"data: " + _json(last) + b"\n\n"
            self._log_done(rlog, choices, arrived)
        except EngineError as exc:  # after the response started: an error event, then done
            rlog.warning("failed: %s: %s", exc.code, exc)
            yield b"data: " + _json(ApiError.from_engine(exc).body()) + b"\n\n"
        except asyncio.CancelledError:
            rlog.info("stream cancelled by the client after %d tokens",
                      sum(c.generated for c in choices))
            raise
        finally:
            await deltas.aclose()
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _log_done(rlog: RequestLog, choices: list[Choice], arrived: float) -> None:
        rlog.info("done: %d tokens, %s, %.3f s", sum(c.generated for c in choices),
                  " ".join(c.finish.name for c in choices), time.monotonic() - arrived)


async def _each(deltas: Deltas, add: Callable[[int, OutputDelta], None]) -> None:
    async for i, d in deltas:
        add(i, d)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def chunks_object(shape: Shape) -> str:
    return shape.chunk_object if isinstance(shape, ChatShape) else shape.object


def _message(i: int, m: dict[str, Any], images: list[ImageRef]) -> dict[str, Any]:
    """A message as templates read it (`chat.content`); its images go to `images`."""
    content, found = parse_content(m.get("content"), f"messages[{i}].content")
    images += found
    return {**m, "content": content} if isinstance(m.get("content"), list) else m
