"""Anthropic's Messages API and /tokenize, /detokenize end to end: the official `anthropic`
client against one real server (the tiny model, --enable-auto-tool-choice --tool-call-parser
hermes, the ChatML template with tools: tests/e2e/tools_server.py).

A Messages request is a chat completion inside, so greedy, it writes what chat completions
writes for the same conversation, with the same token counts; forced tool calls are guided, so
even the tiny random model's `input` validates against the tool's `input_schema`."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import anthropic
import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import Server
from tests.e2e.tools_server import MODEL

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
FLIGHT = {"type": "object", "properties": {
    "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["origin", "to"], "additionalProperties": False}
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
                    {"name": "book_flight", "input_schema": FLIGHT}]
SCHEMAS = {"get_weather": WEATHER, "book_flight": FLIGHT}
SYSTEM = "You answer briefly."
QUESTION = "Name three colours and say why you like them."


@pytest.fixture(scope="module")
def server(shared_tools_server: Server) -> Server:
    return shared_tools_server


@pytest.fixture(scope="module")
def url(server: Server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


@pytest.fixture(scope="module")
def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy_chat(oai: openai.OpenAI, max_tokens: int, **kw: Any) -> Any:
    return oai.chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        extra_body={"return_token_ids": True}, **kw).choices[0]


def greedy_message(max_tokens: int, **kw: Any) -> Any:
    """This client sends sampling parameters through extra_body (2.x dropped the arguments;
    Claude Code and older clients send them as fields all the same)."""
    return dict(model=MODEL, max_tokens=max_tokens, system=SYSTEM,
                messages=[{"role": "user", "content": QUESTION}],
                extra_body={"temperature": 0}, **kw)


def test_messages_equal_the_greedy_chat_answer_and_its_counts(
        claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    chat = greedy_chat(oai, 24)
    kw = greedy_message(24)
    r = claude.messages.create(**kw)
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.message.content  # type: ignore[union-attr]
    assert r.usage.input_tokens == len(chat.prompt_token_ids)
    assert r.usage.output_tokens == len(chat.token_ids)
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.finish_reason]
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == r.content[0].text  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens, final.stop_reason) == (
        r.usage.input_tokens, r.usage.output_tokens, r.stop_reason)
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM,
                                           messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == r.usage.input_tokens


def test_a_stop_sequence_ends_the_text_before_it(claude: anthropic.Anthropic,
                                                 oai: openai.OpenAI) -> None:
    text = greedy_chat(oai, 40).message.content
    words = [w for w in text.split() if len(w) >= 3]
    assert len(words) >= 2, f"the model wrote too little to stop inside: {text!r}"
    stop = words[1][:3]
    want = text[:text.index(stop)]
    r = claude.messages.create(**greedy_message(40, stop_sequences=[stop]))
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == want  # type: ignore[union-attr]
    with claude.messages.stream(**greedy_message(40, stop_sequences=[stop])) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == want  # type: ignore[union-attr]


@pytest.mark.parametrize("choice, sampling", [
    ({"type": "tool", "name": "book_flight"}, {"temperature": 0}),
    ({"type": "tool", "name": "get_weather"}, {"temperature": 1.0, "top_k": 50}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"temperature": 0}),
])
def test_forced_tool_calls_validate_against_their_input_schema(
        claude: anthropic.Anthropic, choice: dict[str, Any], sampling: dict[str, Any]) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=120, tools=TOOLS, tool_choice=choice,
                              messages=[{"role": "user", "content": "Weather, then a flight."}],
                              extra_body=sampling)
    r = claude.messages.create(**kw)
    calls = [b for b in r.content if b.type == "tool_use"]
    assert calls and r.stop_reason == "tool_use", r
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
    if choice["type"] == "tool":
        assert [c.name for c in calls] == [choice["name"]]
    if sampling["temperature"] == 0:  # greedy: the stream writes the same calls
        with claude.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
            (c.name, c.input) for c in calls]
    # The call and its result go back as the next turn.
    follow = claude.messages.create(model=MODEL, max_tokens=8, tools=TOOLS,
                                    messages=[*kw["messages"],
                                              {"role": "assistant", "content": r.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result",
                                                   "tool_use_id": calls[0].id,
                                                   "content": "done"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_structured_output_validates_against_its_schema(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model=MODEL, max_tokens=120, messages=[
        {"role": "user", "content": "Weather as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(r.content[0].text), WEATHER)  # type: ignore[union-attr]


def test_tokenize_and_detokenize_equal_the_hf_tokenizer(url: str, oai: openai.OpenAI,
                                                        tiny_model_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "Tokenize this, please: 42 apples!"
    got = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text,
                                              "return_token_strs": True}, timeout=30).json()
    ids = hf(text)["input_ids"]
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["token_strs"] == hf.convert_ids_to_tokens(ids) and got["max_model_len"] > 0
    back = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": hf.decode(ids)}
    # A chat tokenizes to the prompt a chat completion of it runs.
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert chat["tokens"] == list(greedy_chat(oai, 1).prompt_token_ids)
