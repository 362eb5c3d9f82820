"""Anthropic's Messages API over real HTTP with the official `anthropic` client, on the scripted
engine of tests/openai_api/agents_harness.py: content blocks streamed and not, the exact event
sequence, how turns reach the chat template, tool_choice, errors in Anthropic's shape; and
/tokenize, /detokenize against the HF tokenizer."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem_serve.guided.spec import SpecKind
from tandem_serve.openai_api.agents.tools import AgentSettings
from tests.openai_api.agents_harness import SCRIPTS, TEMPLATE, AgentApp
from tests.tokenizer_utils import sentencepiece_dir

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def app() -> Iterator[AgentApp]:
    served = AgentApp(AgentSettings(auto_tool_choice=True, tool_parser="hermes",
                                    reasoning_parser="qwen3"))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(app: AgentApp) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.url, api_key="none", max_retries=0, timeout=10)


def ask(script: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"SCRIPT:{script}"}]


def blocks(message: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in message.content]


@pytest.mark.parametrize("script, tools", [("hello", None), ("think", None),
                                           ("weather", TOOLS), ("think_call", TOOLS),
                                           ("two", TOOLS)])
def test_create_and_stream_give_the_same_blocks(client: anthropic.Anthropic, script: str,
                                                tools: Any) -> None:
    kw: dict[str, Any] = dict(model="tiny", max_tokens=200, messages=ask(script))
    if tools:
        kw["tools"] = tools
    made = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    want = [{k: v for k, v in b.items() if k != "id"} for b in blocks(made)]
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks(final)] == want
    assert (final.stop_reason, final.usage.output_tokens) == (made.stop_reason,
                                                              made.usage.output_tokens)
    assert made.usage.output_tokens == -(-len(SCRIPTS[script]) // 3)  # PIECE chars a token
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    n = len(made.content)
    assert events.count("content_block_start") == events.count("content_block_stop") == n


def test_block_kinds_stop_reasons_and_the_exact_text_event_sequence(
        app: AgentApp, client: anthropic.Anthropic) -> None:
    r = client.messages.create(model="tiny", max_tokens=100, messages=ask("think_call"),
                               tools=TOOLS)
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    assert r.content[0].thinking == "\nI need the weather.\n"  # type: ignore[union-attr]
    assert r.content[1].input == {"city": "Rome"} and r.stop_reason == "tool_use"  # type: ignore
    r = client.messages.create(model="tiny", max_tokens=100, messages=ask("hello"))
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.content[0].text == SCRIPTS["hello"]  # type: ignore[union-attr]
    cut = client.messages.create(model="tiny", max_tokens=2, messages=ask("hello"))
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    body = {"model": "tiny", "max_tokens": 100, "messages": ask("hello"), "stream": True}
    with httpx.stream("POST", app.url + "/v1/messages", json=body, timeout=10) as sse:
        frames = [f for f in sse.read().decode().split("\n\n") if f]
    events = []
    for frame in frames:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == (
        [], None, 0)
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(e["delta"]["text"] for e in events[2:-3]) == SCRIPTS["hello"]
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": start["usage"]["input_tokens"],
                                   "output_tokens": 10}


def test_turns_reach_the_template_as_chat_messages(app: AgentApp,
                                                   client: anthropic.Anthropic) -> None:
    history: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "SCRIPT:hello"}]}]
    r = client.messages.create(model="tiny", max_tokens=50, tools=TOOLS, messages=history,
                               system=[{"type": "text", "text": "Be brief."}])
    assert r.content[0].text == SCRIPTS["hello"]  # type: ignore[union-attr]
    assert app.engine.prompts[-1] == (  # as decoded: this vocabulary drops the newlines
        "<system>Be brief.<user>Weather?<assistant>Checking.[call toolu_1 get_weather "
        "city=Paris]<tool>18 C[result of toolu_1]<user>SCRIPT:hello"
        "[tools get_weather get_time]<assistant>")
    # The input tokens are the prompt's, as chat completions counts the same conversation,
    # and count_tokens counts the same prompt.
    chat = httpx.post(app.url + "/v1/chat/completions", timeout=10, json={
        "model": "tiny", "max_tokens": 50, "tools": [
            {"type": "function", "function": {"name": t["name"], "parameters": t[
                "input_schema"]}} for t in TOOLS], "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
            {"role": "user", "content": "SCRIPT:hello"}]}).json()
    counted = client.messages.count_tokens(model="tiny", tools=TOOLS, messages=history,
                                           system=[{"type": "text", "text": "Be brief."}])
    assert counted.input_tokens == r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
    # A last assistant turn is continued, not closed.
    client.messages.create(model="tiny", max_tokens=5, messages=[
        *ask("hello"), {"role": "assistant", "content": "Sure, "}])
    assert app.engine.prompts[-1].endswith("<assistant>Sure, ")


def test_tool_choice_any_and_tool_are_guided(app: AgentApp,
                                             client: anthropic.Anthropic) -> None:
    r = client.messages.create(model="tiny", max_tokens=200, messages=ask("required"),
                               tools=TOOLS, tool_choice={"type": "any"},
                               thinking={"type": "disabled"})
    assert [(b.name, b.input) for b in r.content] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    assert r.stop_reason == "tool_use" and app.compiler.specs[-1].field == "tools"
    r = client.messages.create(model="tiny", max_tokens=200, messages=ask("named"),
                               tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                               thinking={"type": "disabled"})
    [call] = r.content
    assert (call.name, call.input) == ("get_weather", {  # type: ignore[union-attr]
        "city": "Paris", "unit": "celsius"}) and r.stop_reason == "tool_use"
    spec = app.compiler.specs[-1]
    assert spec.kind == SpecKind.JSON_SCHEMA and json.loads(spec.value) == WEATHER[
        "input_schema"]
    shaped = client.messages.create(model="tiny", max_tokens=200, messages=ask("named"),
                                    output_config={"format": {"type": "json_schema",
                                                              "schema": WEATHER["input_schema"]}},
                                    cache_control={"type": "ephemeral"},
                                    thinking={"type": "disabled"})
    assert json.loads(shaped.content[0].text) == {  # type: ignore[union-attr]
        "city": "Paris", "unit": "celsius"} and shaped.stop_reason == "end_turn"
    spec = app.compiler.specs[-1]
    assert spec.kind == SpecKind.JSON_SCHEMA and json.loads(spec.value) == WEATHER[
        "input_schema"]
    none = client.messages.create(model="tiny", max_tokens=200, messages=ask("weather"),
                                  tools=TOOLS, tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"] and none.stop_reason == "end_turn"


BAD: list[tuple[str, dict[str, Any]]] = [
    ("messages[0].content[1].source.data: this model does not take images", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "SCRIPT:hello"}, {
            "type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    ("messages[0].content[0].source.media_type", {"messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}]}),
    ("messages[0].content[0]: document blocks are not supported", {"messages": [
        {"role": "user", "content": [{"type": "document", "source": {}}]}]}),
    ("max_tokens: Field required", {"max_tokens": None}),
    ("max_tokens: must be in [1, 512]", {"max_tokens": 100000}),
    ("temperature: must be >= 0", {"temperature": -1}),
    ("tools[0].input_schema", {"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]}),
    ("tools[0].type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}),
    ("stop_sequences", {"stop_sequences": ["x"] * 100}),
    ("messages[1].content[0].input", {"messages": [
        *ask("hello"), {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]}),
    ("frobnicate: unknown parameter", {"frobnicate": 1}),
    ("output_config.format.schema", {"output_config": {"format": {
        "type": "json_schema", "schema": {"type": 7}}}}),
    ("output_config.effort: not supported", {"output_config": {"effort": "high"}}),
]


@pytest.mark.parametrize("message, extra", BAD)
def test_mistakes_are_400s_in_anthropics_shape_naming_the_field(
        app: AgentApp, message: str, extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "max_tokens": 10, "messages": ask("hello"), **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(app.url + "/v1/messages", json=body, timeout=10,
                   headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(message), error


def test_the_client_raises_on_an_unknown_model_and_auto_without_a_parser(
        client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as lost:
        client.messages.create(model="claude-nope", max_tokens=5, messages=ask("hello"))
    assert lost.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    plain = AgentApp(None)
    try:
        c = anthropic.Anthropic(base_url=plain.url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="--enable-auto-tool-choice"):
            c.messages.create(model="tiny", max_tokens=5, messages=ask("weather"),
                              tools=TOOLS, tool_choice={"type": "auto"})
        # Without the flags tools default to none: the call stays text.
        r = c.messages.create(model="tiny", max_tokens=200, messages=ask("weather"),
                              tools=TOOLS)
        assert r.content[0].text == SCRIPTS["weather"]  # type: ignore[union-attr]
    finally:
        plain.stop()


# ------------------------------------------------------------------ /tokenize, /detokenize

def test_tokenize_and_detokenize_equal_the_hf_tokenizer(app: AgentApp) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(sentencepiece_dir()))
    text = "Hello world, tokenize me! 123"

    def post(path: str, **body: Any) -> Any:
        r = httpx.post(app.url + path, json=body, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    got = post("/tokenize", prompt=text, return_token_strs=True)
    ids = hf(text)["input_ids"]
    assert got == {"count": len(ids), "max_model_len": 2048, "tokens": ids,
                   "token_strs": hf.convert_ids_to_tokens(ids)}
    bare = post("/tokenize", prompt=text, add_special_tokens=False)
    assert bare["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] is None
    assert post("/detokenize", tokens=ids) == {"prompt": hf.decode(ids)}
    for opening in (True, False):  # a chat: HF's template rendering, encoded without BOS
        rendered = hf.apply_chat_template(ask("hello"), chat_template=TEMPLATE, tokenize=False,
                                          add_generation_prompt=opening)
        chat = post("/tokenize", messages=ask("hello"), add_generation_prompt=opening)
        assert chat["tokens"] == hf(rendered, add_special_tokens=False)["input_ids"]
        assert chat["count"] == len(chat["tokens"])
    bos = post("/tokenize", messages=ask("hello"), add_special_tokens=True,
               add_generation_prompt=False)
    assert bos["tokens"] == hf(rendered)["input_ids"]
    for path, body, param in [("/detokenize", {"tokens": [5, 10**9]}, "tokens[1]"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": ask("a")}, "prompt")]:
        r = httpx.post(app.url + path, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ random bodies

def _blocks_strategy() -> st.SearchStrategy[Any]:
    text = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
    use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=6),
                                 "name": st.sampled_from(["get_weather", "nope"]),
                                 "input": st.one_of(st.dictionaries(st.text(max_size=5),
                                                                    st.integers()), JSON)})
    result = st.fixed_dictionaries({"type": st.just("tool_result"),
                                    "tool_use_id": st.text(max_size=6),
                                    "content": st.one_of(st.text(max_size=10),
                                                         st.lists(text, max_size=2), JSON)})
    odd = st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document",
                                                          "weird"])})
    return st.lists(st.one_of(text, use, result, odd), max_size=3)


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                              st.floats(allow_nan=False, allow_infinity=False),
                              st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=6), inner,
                                                            max_size=3)), max_leaves=8)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-1, 40), "stream": st.booleans(),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 9),
    "stop_sequences": st.lists(st.text(max_size=4), max_size=3),
    "system": st.one_of(st.text(max_size=10), _blocks_strategy()),
    "tools": st.lists(st.sampled_from([WEATHER, TIME, {"name": "x"}, {"type": "bash"}]),
                      max_size=3),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(
        ["auto", "any", "none", "tool", "odd"]), "name": st.sampled_from(["get_time", "zz"])}),
        JSON),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])}),
    "output_config": st.one_of(st.just({"format": {"type": "json_schema", "schema": {
        "type": "object"}}}), JSON),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(st.text(max_size=20), _blocks_strategy())}), max_size=3),
}


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_bodies_are_answered_200_or_an_anthropic_400(app: AgentApp,
                                                            data: st.DataObject) -> None:
    keys = data.draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=7, unique=True))
    body = {"model": "tiny", "messages": ask("hello"), "max_tokens": 5,
            **{k: data.draw(FIELDS[k] if data.draw(st.integers(0, 5)) else JSON)
               for k in keys}}
    path = data.draw(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
    if path.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools",
                                                       "tool_choice", "thinking")}
    r = httpx.post(app.url + path, json=body, timeout=10)
    assert r.status_code in (200, 400), f"{r.status_code} {body} -> {r.text[:300]}"
    if r.status_code == 400:
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"]
    elif body.get("stream") is True and path == "/v1/messages":
        assert r.text.rstrip().endswith('data: {"type":"message_stop"}'), r.text[-300:]
    else:
        assert r.json()["type" if path == "/v1/messages" else "input_tokens"]
