"""Tools on /v1/chat/completions: `tools` and `tool_choice` validated, how the output is read,
and the guided constraint a required or named choice needs.

    tool_choice   the output                                      read by
    "none"        free text (the tools still reach the template)  nothing: all content
    "auto"        free text                                       the server's --tool-call-parser
    "required"    a JSON array of {"name", "parameters"}, one     tool_parsers.guided
                  anyOf branch per tool (guided decoding)
    named         that function's parameters (guided decoding)    tool_parsers.guided

Without `tool_choice` a request with tools gets "auto" when the server runs with
--enable-auto-tool-choice, else "none". Every mistake is a ValidationError naming the field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.openai_api.agents.message import ToolMode
from tandem_serve.openai_api.agents.tool_parsers.base import ToolParser
from tandem_serve.openai_api.agents.tool_parsers.guided import NamedParser, RequiredParser

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
# A function without `parameters` takes none (OpenAI): only {} is its arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class AgentSettings:
    """The server's flags for tools and reasoning."""

    auto_tool_choice: bool = False
    tool_parser: str = ""  # a name of tool_parsers.TOOL_PARSERS ("" : none)
    reasoning_parser: str = ""  # a name of reasoning.REASONING_PARSERS


@dataclass
class ToolPlan:
    mode: ToolMode
    tools: list[dict[str, Any]] | None  # what the chat template gets
    guided: GuidedSpec | None = None
    parser: ToolParser | None = None
    max_calls: int | None = None


def _check_schema(schema: object, field: str) -> dict[str, Any]:
    import jsonschema

    if not isinstance(schema, dict):
        raise ValidationError(field, "must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValidationError(field, f"is not a valid JSON schema: {exc.message}") from None
    return schema


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function tools only, each with a valid name and parameters schema, names unique."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValidationError(f"{where}.type", "only function tools are supported")
        extra = set(tool) - _TOOL_KEYS
        if extra:
            raise ValidationError(f"{where}.{sorted(extra)[0]}", "unknown parameter")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValidationError(f"{where}.function", "must be an object with a name")
        extra = set(function) - _FUNCTION_KEYS
        if extra:
            raise ValidationError(f"{where}.function.{sorted(extra)[0]}", "unknown parameter")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValidationError(f"{where}.function.name", "must be 1 to 64 letters, digits, "
                                                            f"underscores or dashes, got {name!r}")
        if name in seen:
            raise ValidationError(f"{where}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        if function.get("parameters") is not None:
            _check_schema(function["parameters"], f"{where}.function.parameters")
    return tools


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return NO_PARAMETERS if params is None else params


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty array of calls, each one of the
    tools by name with its parameters."""
    branches = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": parameters(t)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _spec(schema: dict[str, Any], field: str) -> GuidedSpec:
    return GuidedSpec(SpecKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True), field=field)


def _choice(tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None,
            settings: AgentSettings) -> str | dict[str, Any]:
    if tool_choice is None:
        return "auto" if tools and settings.auto_tool_choice else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValidationError("tool_choice", f"must be 'none', 'auto', 'required' or "
                                                 f"a named function, got {tool_choice!r}")
        return tool_choice
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str) or set(tool_choice) - _TOOL_KEYS:
        raise ValidationError("tool_choice", 'a named function is {"type": "function", '
                                             '"function": {"name": ...}}')
    return tool_choice


def plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
         parallel_tool_calls: bool | None, settings: AgentSettings,
         server_parser: ToolParser | None) -> ToolPlan:
    """How a chat request's tools shape its output (ValidationError naming the field)."""
    if tools is not None:
        check_tools(tools)
    choice = _choice(tool_choice, tools, settings)
    if choice != "none" and not tools:
        raise ValidationError("tool_choice", f"{json.dumps(choice)} needs tools")
    assert tools is not None or choice == "none"
    parallel = parallel_tool_calls is not False
    cap = None if parallel else 1
    if choice == "none":
        return ToolPlan(ToolMode.NONE, tools or None)
    assert tools
    if choice == "auto":
        if server_parser is None or not settings.auto_tool_choice:
            raise ValidationError("tool_choice", '"auto" needs a server started with '
                                                 "--enable-auto-tool-choice and "
                                                 "--tool-call-parser NAME")
        return ToolPlan(ToolMode.AUTO, tools, parser=server_parser, max_calls=cap)
    if choice == "required":
        return ToolPlan(ToolMode.REQUIRED, tools, _spec(required_schema(tools, parallel),
                                                         "tools"), RequiredParser(), cap)
    assert isinstance(choice, dict)
    name = choice["function"]["name"]
    for i, tool in enumerate(tools):
        if tool["function"]["name"] == name:
            spec = _spec(parameters(tool), f"tools[{i}].function.parameters")
            return ToolPlan(ToolMode.NAMED, tools, spec, NamedParser(name), 1)
    raise ValidationError("tool_choice", f"names the function {name!r}, which is not in "
                                         f"tools")


def template_message(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls as templates read them: arguments as objects (vLLM
    passes them so; HF templates write them with tojson)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list):
        raise ValidationError(f"messages[{i}].tool_calls", "must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValidationError(f"{where}.function", "must be an object with a name")
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ValidationError(f"{where}.function.arguments",
                                      f"is not valid JSON: {exc}") from None
        out.append({**call, "function": {**function, "arguments": args}})
    return {**message, "tool_calls": out}
