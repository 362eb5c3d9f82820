"""`/v1/responses` served: one JSON object, or OpenAI's event stream.

    response.created, response.in_progress
    per output item, in order (reasoning, message, function calls):
      response.output_item.added
      reasoning:  response.content_part.added, response.reasoning_text.delta...,
                  response.reasoning_text.done, response.content_part.done
      message:    response.content_part.added, response.output_text.delta...,
                  response.output_text.done, response.content_part.done
      call:       response.function_call_arguments.delta..., ...arguments.done
      response.output_item.done
    response.completed

Each event is `event: <type>` + `data: <json>` with an increasing `sequence_number`. A
response cut short by `max_output_tokens` ends with `response.completed` too, its status
"incomplete" (vLLM does the same; the `openai` client's `responses.stream()` accumulates only
up to a `response.completed`). A failure after the first event is an `error` event.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.agents.message import MessageDelta, Output
from tandem_serve.openai_api.chat.serving import SSE_HEADERS, Job, Serving
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.responses.protocol import (
    Envelope,
    ResponsesRequest,
    call_item,
    chat_request,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    renamed,
    text_part,
    usage,
)


class Events:
    """Numbers and frames the events of one stream."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(
            data, separators=(",", ":")).encode() + b"\n\n"


class Items:
    """The output items of a streamed response: each opened by its first delta and closed
    when another kind of item starts, or at the end."""

    def __init__(self, event: Events) -> None:
        self.event = event
        self.done: list[dict[str, Any]] = []  # closed items, in output order
        self.kind = ""  # the open item's: "reasoning", "message", "call" ("": none)
        self.id = ""
        self.text = ""  # the open item's text or arguments
        self.call: tuple[str, str] = ("", "")  # the open call's call_id and name
        self.had_message = False

    @property
    def index(self) -> int:
        return len(self.done)

    def add(self, d: MessageDelta) -> list[bytes]:
        out = []
        if d.reasoning:
            out += self._switch("reasoning")
            out.append(self.event("response.reasoning_text.delta", item_id=self.id,
                                  output_index=self.index, content_index=0, delta=d.reasoning))
            self.text += d.reasoning
        if d.content:
            out += self._switch("message")
            out.append(self.event("response.output_text.delta", item_id=self.id,
                                  output_index=self.index, content_index=0, delta=d.content,
                                  logprobs=[]))
            self.text += d.content
        for call in d.calls:
            if call.id is not None:
                out += self._close("completed")
                out += self._open("call", (call.id, call.name or ""))
            if call.arguments:
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=self.id, output_index=self.index,
                                      delta=call.arguments))
                self.text += call.arguments
        return out

    def finish(self, status: str) -> list[bytes]:
        """Close what is open; a response without a message or a call gets an empty one."""
        out = self._close(status)
        if not self.had_message and not any(i["type"] == "function_call" for i in self.done):
            out += self._open("message") + self._close(status)
        return out

    def _switch(self, kind: str) -> list[bytes]:
        if self.kind == kind:
            return []
        return self._close("completed") + self._open(kind)

    def _open(self, kind: str, call: tuple[str, str] = ("", "")) -> list[bytes]:
        self.kind, self.text, self.call = kind, "", call
        at = dict(output_index=self.index)
        if kind == "reasoning":
            self.id = new_id("rs")
            return [self.event("response.output_item.added",
                               item=reasoning_item(self.id, "", "in_progress"), **at),
                    self.event("response.content_part.added", item_id=self.id, content_index=0,
                               part={"type": "reasoning_text", "text": ""}, **at)]
        if kind == "message":
            self.id, self.had_message = new_id("msg"), True
            return [self.event("response.output_item.added",
                               item=message_item(self.id, None, "in_progress"), **at),
                    self.event("response.content_part.added", item_id=self.id, content_index=0,
                               part=text_part(""), **at)]
        self.id = new_id("fc")
        return [self.event("response.output_item.added",
                           item=call_item(self.id, call[0], call[1], "", "in_progress"), **at)]

    def _close(self, status: str) -> list[bytes]:
        if not self.kind:
            return []
        at = dict(item_id=self.id, output_index=self.index)
        if self.kind == "reasoning":
            item = reasoning_item(self.id, self.text, status)
            part = {"type": "reasoning_text", "text": self.text}
            out = [self.event("response.reasoning_text.done", content_index=0, text=self.text,
                              **at),
                   self.event("response.content_part.done", content_index=0, part=part, **at)]
        elif self.kind == "message":
            item = message_item(self.id, self.text, status)
            out = [self.event("response.output_text.done", content_index=0, text=self.text,
                              logprobs=[], **at),
                   self.event("response.content_part.done", content_index=0,
                              part=text_part(self.text), **at)]
        else:
            item = call_item(self.id, self.call[0], self.call[1], self.text, status)
            out = [self.event("response.function_call_arguments.done", name=self.call[1],
                              arguments=self.text, **at)]
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.done.append(item)
        self.kind = ""
        return out


async def respond(serving: Serving, request: HTTPRequest, body: ResponsesRequest) -> Response:
    try:
        chat = chat_request(body)
        job = await serving.begin(request, chat)
    except ValidationError as exc:
        raise renamed(ApiError.bad_parameter(exc)) from None
    except ApiError as exc:
        raise renamed(exc) from None
    if isinstance(job, Response):
        return job
    choice = body.tool_choice if body.tool_choice is not None else \
        "auto" if body.tools and serving.agents.settings.auto_tool_choice else "none"
    envelope = Envelope(body, job.target.name, choice)
    output = job.choices[0].output or Output()  # plain content reads as a message too
    if body.stream:
        return StreamingResponse(_events(job, envelope, output), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    text = await serving.collect_text(request, job)
    if text is None:
        return Response(status_code=499)
    c = job.choices[0]
    incomplete = c.finish_reason == "length"
    return JSONResponse(envelope.response(
        "incomplete" if incomplete else "completed",
        output_items(output.message(text), incomplete),
        usage(job.prompt_tokens, c.generated), incomplete))


async def _events(job: Job, envelope: Envelope, output: Output) -> AsyncIterator[bytes]:
    event = Events()
    c = job.choices[0]
    yield event("response.created", response=envelope.response("in_progress", []))
    yield event("response.in_progress", response=envelope.response("in_progress", []))
    items, stream = Items(event), output.stream()
    try:
        async for _, d in job.deltas:
            c.update(d)
            frames = items.add(stream.feed(d.text, c.finish_reason is not None))
            if frames:
                yield b"".join(frames)
        incomplete = c.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        yield b"".join(items.finish(status))
        yield event("response.completed", response=envelope.response(
            status, items.done, usage(job.prompt_tokens, c.generated), incomplete))
        job.rlog.info("done: %d tokens, %s", c.generated, c.finish.name)
    except EngineError as exc:
        job.rlog.warning("failed: %s: %s", exc.code, exc)
        error = ApiError.from_engine(exc)
        yield event("error", code=error.code, message=error.message, param=None)
    finally:
        await job.deltas.aclose()
