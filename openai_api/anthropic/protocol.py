"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat
pipeline.

A request becomes a chat completion request and runs through `Serving.begin` like any chat:
the same chat template, tool parsers and guided constraints. `system` (a string or text
blocks) is a system message first; a user turn's `tool_result` blocks become tool messages
and its text blocks one user message, in order; an assistant turn's `tool_use` blocks become
its tool calls (their `input` the arguments) and its text the content. A conversation that
ends with an assistant turn is continued, as Anthropic continues a prefilled answer
(`continue_final_message`). `thinking` blocks of earlier turns do not go back into the
prompt, as the Responses API drops reasoning items. Image blocks (in a user turn or a
tool_result) are chat's image_url parts (`anthropic/content.py`); document blocks are a 400
naming the block.

Tools are custom tools (`name`, `description`, `input_schema`); `tool_choice` `auto` needs
the server's tool parser (--enable-auto-tool-choice), `any` is chat's `required`, `tool` a
named function and `none` leaves the text as text; `disable_parallel_tool_use` is chat's
`parallel_tool_calls: false`. Structured outputs (`output_config.format`, a JSON schema) are
chat's json_schema `response_format`, guided the same way. `thinking` sets the chat
template's `enable_thinking`, which the templates of reasoning models read.

Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, and name
the Messages API's fields (`messages[2].content[1]`, `tools[0].input_schema`,
`stop_sequences`), not the chat request's they were found in.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.anthropic.content import chat_content, is_content_block
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.protocol import ChatCompletionRequest

# Anthropic's error types by HTTP status (its 529 "overloaded" is our 503: starting,
# draining, a process gone).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"),
                                       "message": exc.message}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    # `schema` would shadow BaseModel.schema: the JSON key is an alias.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: str | None = None  # only unset (check_unsupported)


class CountTokensRequest(_Strict):
    """What `/v1/messages/count_tokens` reads: the prompt's parts."""

    model: str | None = None  # None: the one model this server serves
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # A cache breakpoint: prefix caching reuses every prompt's cached prefix without one.
    cache_control: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id goes into the request's log tag
    service_tier: Literal["auto", "standard_only"] | None = None


@dataclass
class Translation:
    """The chat request, and where each of its messages came from (for error names)."""

    chat: ChatCompletionRequest
    origins: list[str] = field(default_factory=list)
    # An image part's chat field (`messages[2].content[0].image_url`) -> its Messages field.
    images: dict[str, str] = field(default_factory=dict)


def _texts(value: object, where: str) -> str:
    """A string, or text blocks joined as chat joins text parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValidationError(where, "must be a string or a list of text blocks")
    out = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ValidationError(f"{where}[{j}]", _unsupported(kind, "text blocks"))
        out.append(block["text"])
    return "\n".join(out)


def _unsupported(kind: object, what: str) -> str:
    if kind == "document":
        return "document blocks are not supported: this server takes text and images only"
    return f"only {what} are supported here, got type {kind!r}"


class _Turns:
    """Anthropic turns as chat messages, each remembering the field it came from."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[str] = []
        self.images: dict[str, str] = {}

    def add(self, message: dict[str, Any], origin: str,
            images: list[tuple[int, str]] | None = None) -> None:
        for part, where in images or []:
            self.images[f"messages[{len(self.messages)}].content[{part}].image_url"] = where
        self.messages.append(message)
        self.origins.append(origin)

    def _content(self, role: str, blocks: list[tuple[str, dict[str, Any]]], origin: str,
                 **extra: Any) -> None:
        content, images = chat_content(blocks)
        self.add({"role": role, **extra, "content": content}, origin, images)

    def _result(self, block: dict[str, Any], at: str) -> None:
        """A tool_result block as a tool message: its content a string, or text and image
        blocks."""
        if not isinstance(block.get("tool_use_id"), str):
            raise ValidationError(f"{at}.tool_use_id", "must be a string")
        value = block.get("content", "")
        if isinstance(value, str):
            value = [{"type": "text", "text": value}]
        if not isinstance(value, list):
            raise ValidationError(f"{at}.content", "must be a string or a list of text and "
                                                   "image blocks")
        for j, b in enumerate(value):
            if not is_content_block(b):
                kind = b.get("type") if isinstance(b, dict) else None
                raise ValidationError(f"{at}.content[{j}]",
                                      _unsupported(kind, "text and image blocks"))
        self._content("tool", [(f"{at}.content[{j}]", b) for j, b in enumerate(value)], at,
                      tool_call_id=block["tool_use_id"])

    def user(self, i: int, content: str | list[dict[str, Any]]) -> None:
        where = f"messages[{i}]"
        if isinstance(content, str):
            self.add({"role": "user", "content": content}, where)
            return
        pending: list[tuple[str, dict[str, Any]]] = []  # text and images before a result
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            if is_content_block(block):
                pending.append((at, block))
            elif block.get("type") == "tool_result":
                if pending:  # what comes before a result stays before it
                    self._content("user", pending, where)
                    pending = []
                self._result(block, at)
            else:
                raise ValidationError(at, _unsupported(block.get("type"), "text, image and "
                                                       "tool_result blocks in a user turn"))
        if pending or not content:
            self._content("user", pending, where)

    def assistant(self, i: int, content: str | list[dict[str, Any]]) -> None:
        where = f"messages[{i}]"
        if isinstance(content, str):
            self.add({"role": "assistant", "content": content}, where)
            return
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use":
                for key in ("id", "name"):
                    if not isinstance(block.get(key), str):
                        raise ValidationError(f"{at}.{key}", "must be a string")
                if not isinstance(block.get("input"), dict):
                    raise ValidationError(f"{at}.input", "must be an object")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind not in ("thinking", "redacted_thinking"):
                raise ValidationError(at, _unsupported(kind, "text, tool_use and thinking "
                                                             "blocks in an assistant turn"))
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        self.add(message, where)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise ValidationError(f"tools[{i}].type", f"only custom tools (name, description, "
                                                      f"input_schema) are supported, got "
                                                      f"{tool.get('type')!r}")
        unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control",
                               "strict"}
        if unknown:
            raise ValidationError(f"tools[{i}].{sorted(unknown)[0]}", "unknown field")
        if not isinstance(tool.get("input_schema"), dict):
            raise ValidationError(f"tools[{i}].input_schema", "must be a JSON schema object")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None,
                                                         bool | None]:
    """Chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValidationError("tool_choice", 'must be {"type": "auto"}, {"type": "any"}, '
                                         '{"type": "none"} or {"type": "tool", "name": ...}')


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ValidationError("thinking.type", f"must be 'enabled', 'adaptive' or "
                                               f"'disabled', got {kind!r}")
    return {"enable_thinking": kind != "disabled"}


def _response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    """Structured outputs (`output_config.format`) as chat's json_schema response format."""
    if config is None:
        return None
    if config.effort is not None:
        raise ValidationError("output_config.effort", "not supported by this server (the "
                                                      "model reasons as its template says); "
                                                      "leave it unset")
    if config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output",
                                                   "schema": config.format.json_schema}}


def chat_request(body: CountTokensRequest) -> Translation:
    """The chat completion request that answers this Messages request."""
    turns = _Turns()
    if body.system is not None:
        system = _texts(body.system, "system")
        if system:
            turns.add({"role": "system", "content": system}, "system")
    for i, m in enumerate(body.messages):
        (turns.user if m.role == "user" else turns.assistant)(i, m.content)
    last = turns.messages[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls")
    choice, parallel = _tool_choice(body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model, "messages": turns.messages, "tools": _tools(body.tools),
        "tool_choice": choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(body.thinking),
        "response_format": _response_format(body.output_config),
        "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if isinstance(body, MessagesRequest):
        user = (body.metadata or {}).get("user_id")
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences,
                      stream=body.stream, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k, user=user if isinstance(user, str) else None)
    return Translation(ChatCompletionRequest.model_validate(fields), turns.origins,
                       turns.images)


_RENAMES = [(re.compile(r"^stop(?=\[|$)"), "stop_sequences"),
            (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^chat_template_kwargs"), "thinking"),
            (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
            (re.compile(r"^response_format"), "output_config.format")]


def renamed(exc: ApiError, origins: list[str], images: dict[str, str] | None = None
            ) -> ApiError:
    """A chat request's error with the Messages API's field names."""
    if not exc.param:
        return exc
    param = exc.param
    for pattern, name in _RENAMES:
        param = pattern.sub(name, param)
    image = re.match(r"^messages\[\d+\]\.content\[\d+\]\.image_url", param)
    at = re.match(r"^messages\[(\d+)\]", param)
    if image and image.group() in (images or {}):
        param = (images or {})[image.group()] + param[image.end():]
    elif at and int(at.group(1)) < len(origins):
        param = origins[int(at.group(1))] + param[at.end():]
    message = exc.message
    if message.startswith(exc.param):
        message = param + message[len(exc.param):]
    return ApiError(exc.status, message, param, exc.code)
