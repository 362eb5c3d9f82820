"""`/v1/messages` served: one Message object, or Anthropic's event stream.

    message_start                       the message, empty, with the input tokens
    per content block, in order (thinking, text, tool_use):
      content_block_start               its type, empty (a tool_use's id and name)
      content_block_delta...            thinking_delta / text_delta / input_json_delta
      content_block_stop
    message_delta                       stop_reason, stop_sequence, the usage
    message_stop

Each event is `event: <type>` + `data: <json>`. Blocks come from the chat choice's message
(openai_api/agents/message.py: the reasoning parser's thought, the content, the tool
parser's calls), so a stream adds up to the non-streamed content however the engine's
deltas were cut. A failure after the first event is an `error` event.

`stop_reason`: `max_tokens` when the output was cut at max_tokens (or the context),
`stop_sequence` (with `stop_sequence`) when one of `stop_sequences` ended it, `tool_use`
when the message holds calls, else `end_turn`. `usage` counts as chat completions do: the
rendered prompt's tokens, the generated tokens.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.agents.message import Message, MessageDelta, Output
from tandem_serve.openai_api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    Translation,
    chat_request,
    error_body,
    renamed,
)
from tandem_serve.openai_api.chat.serving import SSE_HEADERS, Job, Serving
from tandem_serve.openai_api.chat.shapes import Choice
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.tokenize import rendered
from tandem_serve.proto.request_params import FinishReason


def _event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def stop_reason(c: Choice, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish == FinishReason.STOP_SEQUENCE:
        return "stop_sequence", c.stop_sequence
    return ("tool_use" if has_calls else "end_turn"), None


def usage(job: Job, c: Choice) -> dict[str, int]:
    return {"input_tokens": job.prompt_tokens, "output_tokens": c.generated}


def _tool_input(arguments: str) -> Any:
    """A call's arguments as the object a tool_use block holds; arguments cut short by
    max_tokens are not an object, and read as an empty one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: Message) -> list[dict[str, Any]]:
    """The non-streamed content: the thought, the text, the calls; a message with none of
    them is one empty text block (as the stream's)."""
    out: list[dict[str, Any]] = []
    if message.reasoning:
        out.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        out.append({"type": "text", "text": message.content})
    out += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)}
            for c in message.calls]
    return out or [{"type": "text", "text": ""}]


class Blocks:
    """The content blocks of a stream: each opened by its first delta and stopped when
    another starts, or at the end."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened
        self.kind = ""  # the open block's ("": none)

    def add(self, d: MessageDelta) -> list[bytes]:
        out = []
        if d.reasoning:
            out += self._switch("thinking", {"thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            out += self._switch("text", {"text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.calls:
            if call.id is not None:
                out += self._stop() + self._start("tool_use", {"id": call.id,
                                                               "name": call.name or "",
                                                               "input": {}})
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": call.arguments}))
        return out

    def finish(self) -> list[bytes]:
        out = self._stop()
        if not self.count:
            out += self._start("text", {"text": ""}) + self._stop()
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.count - 1, delta=delta)

    def _switch(self, kind: str, empty: dict[str, Any]) -> list[bytes]:
        return [] if self.kind == kind else self._stop() + self._start(kind, empty)

    def _start(self, kind: str, empty: dict[str, Any]) -> list[bytes]:
        self.kind = kind
        self.count += 1
        return [_event("content_block_start", index=self.count - 1,
                       content_block={"type": kind, **empty})]

    def _stop(self) -> list[bytes]:
        if not self.kind:
            return []
        self.kind = ""
        return [_event("content_block_stop", index=self.count - 1)]


def _message(msg_id: str, model: str, content: list[dict[str, Any]],
             reason: tuple[str | None, str | None], use: dict[str, int]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": use}


def _renamed(error: ApiError, translation: Translation | None) -> ApiError:
    if translation is None:  # the translation itself failed: its names are the Messages API's
        return renamed(error, [])
    return renamed(error, translation.origins, translation.images)


async def _begin(serving: Serving, request: HTTPRequest, body: MessagesRequest
                 ) -> Job | Response:
    translation: Translation | None = None
    try:
        translation = chat_request(body)
        return await serving.begin(request, translation.chat)
    except ValidationError as exc:
        error = ApiError.bad_parameter(exc)
    except ApiError as exc:
        error = exc
    raise _renamed(error, translation) from None


async def create_message(serving: Serving, request: HTTPRequest, body: MessagesRequest
                         ) -> Response:
    job = await _begin(serving, request, body)
    if isinstance(job, Response):
        return job
    msg_id = f"msg_{secrets.token_hex(12)}"
    c = job.choices[0]
    output = c.output or Output()  # plain content reads as a message too
    if body.stream:
        return StreamingResponse(_events(job, msg_id, output), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    text = await serving.collect_text(request, job)
    if text is None:
        return Response(status_code=499)
    message = output.message(text)
    return JSONResponse(_message(msg_id, job.target.name, content_blocks(message),
                                 stop_reason(c, bool(message.calls)), usage(job, c)))


async def _events(job: Job, msg_id: str, output: Output) -> AsyncIterator[bytes]:
    c = job.choices[0]
    yield _event("message_start", message=_message(
        msg_id, job.target.name, [], (None, None), {"input_tokens": job.prompt_tokens,
                                                    "output_tokens": 0}))
    blocks, stream = Blocks(), output.stream()
    try:
        async for _, d in job.deltas:
            c.update(d)
            frames = blocks.add(stream.feed(d.text, c.finish_reason is not None))
            if frames:
                yield b"".join(frames)
        yield b"".join(blocks.finish())
        reason, sequence = stop_reason(c, stream.has_calls)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage=usage(job, c))
        yield _event("message_stop")
        job.rlog.info("done: %d tokens, %s", c.generated, c.finish.name)
    except EngineError as exc:
        job.rlog.warning("failed: %s: %s", exc.code, exc)
        yield _event("error", error=error_body(ApiError.from_engine(exc))["error"])
    finally:
        await job.deltas.aclose()


async def count_tokens(serving: Serving, body: CountTokensRequest) -> dict[str, int]:
    """The input tokens a Messages request of these parts would count."""
    translation: Translation | None = None
    try:
        translation = chat_request(body)
        serving.models.resolve(body.model)
        prompt = await rendered(serving, translation.chat)
    except ValidationError as exc:
        raise _renamed(ApiError.bad_parameter(exc), translation) from None
    except EngineError as exc:
        raise ApiError.from_engine(exc) from None
    return {"input_tokens": len(prompt.ids)}
