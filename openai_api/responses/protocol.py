"""`POST /v1/responses`: OpenAI's Responses API (text) over the chat pipeline.

A request becomes a chat completion request (`instructions` a system message first, `input` a
user message or a list of items: messages, `function_call` and `function_call_output` items,
which become assistant tool calls and tool messages), runs through `Serving.begin` with one
choice, and its message (reasoning, content, calls: openai_api/agents/message.py) becomes output
items: `reasoning`, `message` (one `output_text` part), `function_call`. The answer is one
JSON object or the event stream of openai_api/responses/serving.py.

Stateless: `store: true`, `previous_response_id` and `background: true` are a 400 naming the
field (nothing is kept between requests), as are other tools than functions, non-text input
parts, `reasoning` options and `truncation: "auto"`. Parameter names in errors are the
Responses API's (`max_output_tokens`, `text.format`, `input[2].content`, `tools[0].name`).
"""
from __future__ import annotations

import re
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.agents.message import Message
from tandem_serve.openai_api.chat.content import image_part
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.protocol import ChatCompletionRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a cache hint: prefix caching needs none
    service_tier: str | None = None
    # Only their neutral values pass (check_unsupported).
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def check_unsupported(body: ResponsesRequest) -> None:
    why = {"store": "responses are not stored; leave it unset or false",
           "previous_response_id": "responses are not stored; send the whole conversation "
                                   "as input",
           "background": "background responses need storage",
           "truncation": "only 'disabled'", "include": "leave it unset or empty",
           "reasoning": "reasoning options; the model reasons as its template says",
           "max_tool_calls": "leave it unset", "top_logprobs": "leave it unset or 0",
           "service_tier": "only 'auto' or 'default'"}
    bad = {"store": body.store, "previous_response_id": body.previous_response_id is not None,
           "background": body.background, "truncation": body.truncation == "auto",
           "include": bool(body.include), "reasoning": bool(body.reasoning),
           "max_tool_calls": body.max_tool_calls is not None,
           "top_logprobs": bool(body.top_logprobs),
           "service_tier": body.service_tier not in (None, "auto", "default")}
    for field, is_bad in bad.items():
        if is_bad:
            raise ValidationError(field, f"not supported by this server ({why[field]})")


def _text(value: object, field: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValidationError(field, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise ValidationError(f"{field}[{j}]", f"only text parts are supported, got "
                                                   f"type {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _content(value: object, field: str) -> str | list[dict[str, Any]]:
    """A message's content: text, or (with `input_image` parts) chat content parts in
    order, each image as chat's `image_url` part (`chat.content` reads both)."""
    if not isinstance(value, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in value):
        return _text(value, field)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        if part.get("type") == "input_image":
            parts.append({"type": "image_url",
                          "image_url": {"url": image_part(part, f"{field}[{j}]").url}})
        elif isinstance(part, dict) and isinstance(part.get("text"), str) and \
                part.get("type") in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else None
            raise ValidationError(f"{field}[{j}]", f"only text and image parts are "
                                                   f"supported, got type {kind!r}")
    return parts


def _item(i: int, item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    kind = item.get("type", "message")
    where = f"input[{i}]"
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ValidationError(f"{where}.role", f"must be user, assistant, system or "
                                                   f"developer, got {role!r}")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ValidationError(f"{where}.{key}", "must be a string")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the same turn's calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ValidationError(f"{where}.call_id", "must be a string")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), f"{where}.output")})
    elif kind != "reasoning":  # earlier thoughts do not go back into the prompt
        raise ValidationError(f"{where}.type", f"{kind!r} items are not supported")


def _tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None,
                                            str | dict[str, Any] | None]:
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise ValidationError(f"tools[{i}].type", f"only function tools are "
                                                          f"supported, got {tool.get('type')!r}")
            tools.append({"type": "function",
                          "function": {k: v for k, v in tool.items() if k != "type"}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValidationError("tool_choice", "'none', 'auto', 'required' or "
                                                 '{"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that produces this response."""
    check_unsupported(body)
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            _item(i, item, messages)
    if not messages:
        raise ValidationError("input", "must not be empty")
    fmt = body.text.format if body.text is not None else None
    response_format: dict[str, Any] | None = None
    if fmt is not None and fmt.type != "text":
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            response_format["json_schema"] = {"name": fmt.name or "response",
                                              "schema": fmt.json_schema, "strict": fmt.strict}
    tools, choice = _tools(body)
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "max_completion_tokens":
        body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "stream": body.stream, "response_format": response_format, "tools": tools,
        "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user or body.safety_identifier})


# Chat field names in errors -> the Responses API's.
_RENAMES = [(re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^messages"), "input")]


def renamed(exc: ApiError) -> ApiError:
    if not exc.param:
        return exc
    param = exc.param
    for pattern, name in _RENAMES:
        param = pattern.sub(name, param)
    message = exc.message
    if message.startswith(exc.param):
        message = param + message[len(exc.param):]
    return ApiError(exc.status, message, param, exc.code)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Envelope:
    """What every response object of one request repeats."""

    def __init__(self, body: ResponsesRequest, model: str, tool_choice: str | dict[str, Any]
                 ) -> None:
        self.id = new_id("resp")
        self.created = int(time.time())
        self.body = body
        self.model = model
        self.tool_choice = tool_choice

    def response(self, status: str, output: list[dict[str, Any]],
                 use: dict[str, Any] | None = None, incomplete: bool = False
                 ) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": None, "metadata": b.metadata or {}, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": {"type": "text"}} if b.text is None or b.text.format is None
            else b.text.model_dump(exclude_none=True, by_alias=True),
            "tool_choice": self.tool_choice, "tools": b.tools or [],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled",
            "usage": use, "user": b.user}


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if text is not None else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: Message, incomplete: bool) -> list[dict[str, Any]]:
    """The non-streamed output: reasoning, the message, the calls; a response cut short
    leaves its last item incomplete (as a stream closes the others on the way)."""
    out = []
    if message.reasoning:
        out.append(reasoning_item(new_id("rs"), message.reasoning, "completed"))
    if message.content is not None or not message.calls:
        out.append(message_item(new_id("msg"), message.content or "", "completed"))
    out += [call_item(new_id("fc"), c.id, c.name, c.arguments, "completed")
            for c in message.calls]
    if incomplete:
        out[-1]["status"] = "incomplete"
    return out
