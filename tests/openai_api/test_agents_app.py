"""Tools, reasoning and the Responses API over real HTTP with the official `openai` client, on
a scripted engine whose output is forced (tests/openai_api/agents_harness.py): the HTTP
shapes of tool calls and thoughts, streamed and not, and the 400s."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest
from openai.types.responses import Response

from tandem_serve.guided.spec import SpecKind
from tandem_serve.openai_api.agents.tools import AgentSettings
from tests.openai_api.agents_harness import SCRIPTS, AgentApp, user

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def agents() -> Iterator[AgentApp]:
    app = AgentApp(AgentSettings(auto_tool_choice=True, tool_parser="hermes",
                                 reasoning_parser="qwen3"))
    yield app
    app.stop()


@pytest.fixture(scope="module")
def plain() -> Iterator[AgentApp]:
    app = AgentApp(None)
    yield app
    app.stop()


def client(app: AgentApp) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.url + "/v1", api_key="none", max_retries=0)


def chat(app: AgentApp, script: str, **kw: Any) -> Any:
    return client(app).chat.completions.create(model="tiny", messages=user(script), **kw)


def joined_stream(app: AgentApp, script: str, **kw: Any) -> tuple[list[Any], dict[str, Any]]:
    chunks = list(chat(app, script, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "order": []}
    for chunk in chunks[1:]:
        delta = chunk.choices[0].delta
        assert delta.role is None
        kind = ("reasoning" if getattr(delta, "reasoning_content", None) else "content"
                if delta.content else "calls" if delta.tool_calls else None)
        if kind and (not out["order"] or out["order"][-1] != kind):
            out["order"].append(kind)
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        out["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # the first delta of a call: id, type, name
                assert call.type == "function" and call.function.name
                out["calls"][call.index] = [call.id, call.function.name,
                                            call.function.arguments]
            else:
                assert call.function.name is None and call.type is None
                out["calls"][call.index][2] += call.function.arguments
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    out["finish"] = chunks[-1].choices[0].finish_reason
    return chunks, out


def test_auto_calls_parse_and_stream_alike(agents: AgentApp) -> None:
    r = chat(agents, "weather", tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    _, streamed = joined_stream(agents, "weather", tools=TOOLS)
    assert streamed["content"] == "Let me check." and streamed["finish"] == "tool_calls"
    assert streamed["order"] == ["content", "calls"]
    [(cid, name, args)] = streamed["calls"].values()
    assert (name, args) == ("get_weather", call.function.arguments)
    two = chat(agents, "two", tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in two.choices[0].message.tool_calls or []] == [
        "get_weather"]
    assert chat(agents, "hello", tools=TOOLS).choices[0].finish_reason == "stop"
    # tool_choice none: the tools reach the template, the text stays text.
    none = chat(agents, "weather", tools=TOOLS, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and "<tool_call>" in (none.message.content or "")
    assert "[tools get_weather get_time]" in agents.engine.prompts[-1]


def test_reasoning_splits_before_content_streamed_and_not(agents: AgentApp) -> None:
    r = chat(agents, "think")
    message = r.choices[0].message
    assert message.reasoning_content == "\nThe user wants 2+2.\n"  # type: ignore[attr-defined]
    assert message.reasoning == message.reasoning_content  # type: ignore[attr-defined]
    assert message.content == "\n\nIt is 4."
    _, streamed = joined_stream(agents, "think")
    assert streamed["order"] == ["reasoning", "content"]
    assert (streamed["reasoning"], streamed["content"]) == (
        message.reasoning_content, message.content)  # type: ignore[attr-defined]
    # Tool calls are read from the content after the thought.
    r = chat(agents, "think_call", tools=TOOLS)
    assert r.choices[0].message.reasoning_content == "\nI need the weather.\n"  # type: ignore
    assert [c.function.name for c in r.choices[0].message.tool_calls or []] == ["get_weather"]
    _, streamed = joined_stream(agents, "think_call", tools=TOOLS)
    assert streamed["order"] == ["reasoning", "calls"] and streamed["finish"] == "tool_calls"
    # Qwen3 without thinking: the template closes the thought, the output is all content.
    off = chat(agents, "think", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert agents.engine.prompts[-1].endswith("</think>\n\n")
    assert off.choices[0].message.content == SCRIPTS["think"]
    assert off.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]


def test_router_reasoning_switches_pass_at_true_and_name_the_field_at_false(
        agents: AgentApp, plain: AgentApp) -> None:
    """sglang-router sends separate_reasoning / stream_reasoning true on every chat body."""
    on = {"separate_reasoning": True, "stream_reasoning": True}
    assert chat(agents, "think", extra_body=on).choices[0].message.content == "\n\nIt is 4."
    for name in on:
        with pytest.raises(openai.BadRequestError, match=name):
            chat(agents, "think", extra_body={name: False})
        # Without a reasoning parser either value leaves the answer as it is (as sglang).
        assert chat(plain, "think", extra_body={name: False}).choices[0].message.content


def test_required_and_named_choices_are_guided_calls(agents: AgentApp) -> None:
    r = chat(agents, "required", tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    _, streamed = joined_stream(agents, "required", tools=TOOLS, tool_choice="required")
    assert [(n, a) for _, n, a in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in calls]
    # With a reasoning parser the constraint applies after the thought: a grammar.
    spec = agents.compiler.specs[-1]
    assert spec.kind == SpecKind.GRAMMAR and "THOUGHT" in spec.value and "%json" in spec.value
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(agents, "named", tools=TOOLS, tool_choice=named,
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    [call] = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "stop"  # vLLM's convention for a named function
    assert call.function.arguments == SCRIPTS["named"]
    spec = agents.compiler.specs[-1]  # the thought is closed in the prompt: the schema as is
    assert (spec.kind, spec.field) == (SpecKind.JSON_SCHEMA, "tools[0].function.parameters")
    assert json.loads(spec.value) == WEATHER["function"]["parameters"]  # type: ignore[index]
    _, streamed = joined_stream(agents, "named", tools=TOOLS, tool_choice=named)
    assert list(streamed["calls"].values())[0][1:] == ["get_weather", SCRIPTS["named"]]
    cut = chat(agents, "required", tools=TOOLS, tool_choice="required", max_tokens=5)
    assert cut.choices[0].finish_reason == "length"


def test_the_template_gets_calls_as_objects_and_tool_results(agents: AgentApp) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C SCRIPT:hello"}]
    r = client(agents).chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                               tools=TOOLS)
    assert r.choices[0].message.content == SCRIPTS["hello"]
    prompt = agents.engine.prompts[-1]
    assert "[call call_1 get_weather city=Paris]" in prompt
    assert "[result of call_1]" in prompt and "[tools get_weather get_time]" in prompt


BAD: list[tuple[str, dict[str, Any]]] = [
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                     "function": {"name": "nope"}}}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}),
    ("tools[0].function.parameters", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]}),
    ("tools[1].function.name", {"tools": [TIME, TIME]}),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required",
                     "response_format": {"type": "json_object"}}),
    ("guided_grammar", {"guided_grammar": 'root ::= "a"'}),
    ("messages[0].tool_calls[0].function.arguments", {"messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{nope"}}]}, {"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("param, extra", BAD)
def test_mistakes_are_400s_naming_the_field(agents: AgentApp, param: str,
                                            extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": user("hello"), **extra}
    r = httpx.post(agents.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auto_needs_the_server_flags(plain: AgentApp) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(plain, "weather", tools=TOOLS, tool_choice="auto")
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in err.value.message
    # Without the flags tools default to "none"; a named choice is guided all the same.
    r = chat(plain, "weather", tools=TOOLS)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert not hasattr(r.choices[0].message, "reasoning_content")
    r = chat(plain, "named", tools=TOOLS, tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}})
    assert r.choices[0].message.tool_calls[0].function.arguments == SCRIPTS["named"]  # type: ignore
    assert plain.compiler.specs[-1].kind == SpecKind.JSON_SCHEMA


# ------------------------------------------------------------------ the Responses API

RESPONSE_TOOLS = [{"type": "function", "name": "get_weather",
                   "parameters": WEATHER["function"]["parameters"]},  # type: ignore[index]
                  {"type": "function", "name": "get_time", "parameters": None}]


def test_responses_create_text_reasoning_and_calls(agents: AgentApp) -> None:
    c = client(agents)
    r = c.responses.create(model="tiny", input="Hi SCRIPT:hello", max_output_tokens=100)
    assert r.output_text == SCRIPTS["hello"] and r.status == "completed"
    assert r.usage is not None and r.usage.output_tokens == -(-len(SCRIPTS["hello"]) // 3)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    Response.model_validate(r.model_dump())  # every field of OpenAI's shape
    r = c.responses.create(model="tiny", input="SCRIPT:think", instructions="Be brief.")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nThe user wants 2+2.\n"  # type: ignore[union-attr]
    assert r.output_text == "\n\nIt is 4."
    assert agents.engine.prompts[-1].startswith("<system>Be brief.")
    r = c.responses.create(model="tiny", input="SCRIPT:weather", tools=RESPONSE_TOOLS)  # type: ignore
    assert [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and call.call_id.startswith("call_")  # type: ignore
    # The call's result goes back as input items.
    follow = [{"role": "user", "content": "Weather?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,  # type: ignore
               "arguments": call.arguments},  # type: ignore[union-attr]
              {"type": "function_call_output", "call_id": call.call_id,  # type: ignore
               "output": "18 C SCRIPT:hello"}]
    r = c.responses.create(model="tiny", input=follow, tools=RESPONSE_TOOLS)  # type: ignore
    assert r.output_text == SCRIPTS["hello"]
    assert f"[result of {call.call_id}]" in agents.engine.prompts[-1]  # type: ignore
    cut = c.responses.create(model="tiny", input="SCRIPT:hello", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("script, tools", [("hello", None), ("think", None),
                                           ("think_call", RESPONSE_TOOLS),
                                           ("two", RESPONSE_TOOLS)])
def test_responses_stream_accumulates_to_the_created_response(agents: AgentApp, script: str,
                                                              tools: Any) -> None:
    c = client(agents)
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    created = c.responses.create(model="tiny", input=f"SCRIPT:{script}", **kw)
    with c.responses.stream(model="tiny", input=f"SCRIPT:{script}", **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == created.output_text
    assert [o.type for o in final.output] == [o.type for o in created.output]
    for got, want in zip(final.output, created.output, strict=True):
        if got.type == "function_call":
            assert (got.name, got.arguments) == (want.name, want.arguments)  # type: ignore
    if script == "hello":
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         *["response.output_text.delta"] * kinds.count(
                             "response.output_text.delta"),
                         "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]


@pytest.mark.parametrize("param, extra", [
    ("store", {"store": True}), ("previous_response_id", {"previous_response_id": "resp_1"}),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    # An image to a text-only model (a VL model takes input_image parts: tests/e2e/test_vision).
    ("input[0].content[0].image_url", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}),
    ("max_output_tokens", {"max_output_tokens": 100000}),
    ("text.format.schema", {"text": {"format": {"type": "json_schema", "name": "x",
                                                "schema": {"type": 7}}}}),
    ("tool_choice", {"tools": RESPONSE_TOOLS, "tool_choice": {"type": "function",
                                                              "name": "nope"}}),
    ("frobnicate", {"frobnicate": 1}),
])
def test_responses_mistakes_name_the_responses_field(agents: AgentApp, param: str,
                                                      extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "input": "SCRIPT:hello", **extra}
    r = httpx.post(agents.url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_mistral_keeps_its_special_marker_and_drops_the_eos_text() -> None:
    app = AgentApp(AgentSettings(auto_tool_choice=True, tool_parser="mistral"))
    try:
        r = chat(app, "mistral", tools=TOOLS)
        assert app.engine.options[-1].skip_special_tokens is False  # [TOOL_CALLS] survives
        message = r.choices[0].message
        assert message.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls or []
        assert len(call.id) == 9 and call.function.arguments == '{"city": "Paris"}'
        _, streamed = joined_stream(app, "mistral", tools=TOOLS)
        assert streamed["content"] == "Sure."
        assert [c[1:] for c in streamed["calls"].values()] == [["get_weather",
                                                                '{"city": "Paris"}']]
        chat(app, "mistral", tools=TOOLS, extra_body={"skip_special_tokens": True})
        assert app.engine.options[-1].skip_special_tokens is True  # the request's word
    finally:
        app.stop()
