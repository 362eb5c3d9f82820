"""Tools and the Responses API end to end: the official `openai` client against one real
server (the tiny model, --enable-auto-tool-choice --tool-call-parser hermes, and a ChatML
chat template with tools through --chat-template).

Required and named tool choices are guided, so even a tiny random model writes calls whose
arguments validate against their tool's schema, greedy or sampled, streamed or not. The
schemas bound every string (an unbounded one lets a random model write until max_tokens).
Reasoning output needs a model that writes `</think>`: its HTTP shapes are proven over a
forced output in tests/openai_api/test_agents_app.py."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.server import Server
from tests.e2e.tools_server import MODEL

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "tomorrow": {"type": "boolean"}}, "required": ["city", "unit"],
    "additionalProperties": False}
FLIGHT = {"type": "object", "properties": {
    "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["origin", "to"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_flight", "parameters": FLIGHT}}]
SCHEMAS = {"get_weather": WEATHER, "book_flight": FLIGHT}
ASK = [{"role": "user", "content": "What is the weather in Paris? Then book me a flight."}]


@pytest.fixture(scope="module")
def server(shared_tools_server: Server) -> Server:
    return shared_tools_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                         max_retries=0, timeout=120)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.id.startswith("call_") and call.type == "function"
                calls[call.index] = [call.function.name, call.function.arguments]
            else:
                calls[call.index][1] += call.function.arguments
        finish = choice.finish_reason or finish
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)], finish


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11},
                                      {"temperature": 1.3, "seed": 5}])
def test_required_calls_validate_and_stream_alike(client: openai.OpenAI,
                                                  sampling: dict[str, Any]) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_tokens=120, **sampling)
    r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls or [])
    calls = calls_of(choice.message)
    check_calls(calls)
    assert streamed_calls(client, **kw) == (calls, "tool_calls")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI,
                                                         sampling: dict[str, Any]) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
              tool_choice={"type": "function", "function": {"name": "book_flight"}},
              **sampling)
    r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert r.choices[0].finish_reason == "stop"
    calls = calls_of(r.choices[0].message)
    assert [name for name, _ in calls] == ["book_flight"]
    check_calls(calls)
    assert streamed_calls(client, **kw) == (calls, "stop")


def test_none_and_auto_and_a_conversation_that_goes_on(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,  # type: ignore
                                          tool_choice="none", max_tokens=16, temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")
    # auto (the default with tools on this server): text or calls, whatever the model wrote.
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,  # type: ignore
                                          max_tokens=24, temperature=0)
    message = auto.choices[0].message
    assert message.content is not None or message.tool_calls
    first = client.chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0)
    [call] = first.choices[0].message.tool_calls or []
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    follow = client.chat.completions.create(model=MODEL, messages=history,  # type: ignore
                                            tools=TOOLS, max_tokens=12, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = client.completions.create(model=MODEL, prompt=follow.choices[0]  # type: ignore
                                       .prompt_token_ids, max_tokens=1, echo=True).choices[0]
    assert '"arguments": {"' in prompt.text  # the template got the arguments as an object
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt.text


def test_a_schema_guided_decoding_cannot_compile_is_a_400_naming_it(
        client: openai.OpenAI) -> None:
    lookahead = {"type": "object", "properties": {"a": {"type": "string",
                                                        "pattern": "^(?=x)x$"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f",
                                                         "parameters": lookahead}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=ASK, tools=tools, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "f"}})
    assert isinstance(err.value.body, dict)
    assert err.value.body["param"] == "tools[1].function.parameters", err.value.body


def test_responses_equal_the_greedy_chat_answer(client: openai.OpenAI) -> None:
    question = "Name three colours."
    chat = client.chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=20, extra_body={"return_token_ids": True})
    r = client.responses.create(model=MODEL, input=question, temperature=0,
                                max_output_tokens=20)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == len(
        chat.choices[0].prompt_token_ids)
    assert r.usage.output_tokens == len(chat.choices[0].token_ids)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    with client.responses.stream(model=MODEL, input=question, temperature=0,
                                 max_output_tokens=20) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.usage is not None and final.usage.output_tokens == r.usage.output_tokens
    # Tools through the Responses API: a required call is a function_call output item.
    flat = [{"type": "function", "name": t["function"]["name"],  # type: ignore[index]
             "parameters": t["function"]["parameters"]} for t in TOOLS]  # type: ignore[index]
    called = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=flat,  # type: ignore
                                     tool_choice="required", parallel_tool_calls=False,
                                     temperature=0, max_output_tokens=120)
    [item] = [o for o in called.output if o.type == "function_call"]
    check_calls([(item.name, item.arguments)])
