"""`tools` / `tool_choice` planning, the schemas of required and named choices, the grammar
a constraint becomes after a thought, and the chat templates tools select."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import jsonschema
import pytest

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.guided.compile import Compiler
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.openai_api.agents.message import ToolMode
from tandem_serve.openai_api.agents.reasoning import Start, after_thought
from tandem_serve.openai_api.agents.tool_parsers import tool_parser
from tandem_serve.openai_api.agents.tools import (
    NO_PARAMETERS,
    AgentSettings,
    plan,
    required_schema,
    template_message,
)
from tandem_serve.openai_api.chat.chat_template import ChatTemplate, template_source
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import sentencepiece_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
AUTO = AgentSettings(auto_tool_choice=True, tool_parser="hermes")


def test_default_choice_follows_the_server_flags() -> None:
    assert plan([WEATHER], None, None, AgentSettings(), None).mode == ToolMode.NONE
    auto = plan([WEATHER], None, None, AUTO, tool_parser("hermes"))
    assert (auto.mode, auto.guided, auto.tools) == (ToolMode.AUTO, None, [WEATHER])
    assert plan(None, None, None, AUTO, tool_parser("hermes")).mode == ToolMode.NONE
    assert plan([WEATHER], "none", None, AUTO, tool_parser("hermes")).tools == [WEATHER]


def test_required_is_a_non_empty_array_of_the_tools_calls() -> None:
    p = plan([WEATHER, NOW], "required", False, AgentSettings(), None)
    assert p.mode == ToolMode.REQUIRED and p.guided is not None and p.max_calls == 1
    assert (p.guided.kind, p.guided.field) == (SpecKind.JSON_SCHEMA, "tools")
    schema = json.loads(p.guided.value)
    assert schema == json.loads(json.dumps(required_schema([WEATHER, NOW], False),
                                           sort_keys=True))
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "now", "parameters": {"x": 1}}], ok + ok,
                [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema([NOW], True)["items"]["anyOf"][0]["properties"]["parameters"] \
        == NO_PARAMETERS


def test_a_named_choice_is_its_parameters_schema() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    p = plan([NOW, WEATHER], named, None, AgentSettings(), None)
    assert p.mode == ToolMode.NAMED and p.guided is not None
    assert p.guided.field == "tools[1].function.parameters"
    assert json.loads(p.guided.value) == WEATHER["function"]["parameters"]  # type: ignore


@pytest.mark.parametrize("tools, choice, field, message", [
    ([WEATHER], "auto", "tool_choice", "--enable-auto-tool-choice"),
    (None, "required", "tool_choice", "needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "x"}}, "tool_choice", "not in tools"),
    ([WEATHER], {"type": "function", "name": "get_weather"}, "tool_choice", "a named function"),
    ([WEATHER], "always", "tool_choice", "must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name",
     "letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}], None,
     "tools[0].function.parameters", "not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
     "tools[0].function.parameters", "schema object"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None,
     "tools[0].function.extra", "unknown"),
    ([{"type": "retrieval"}], None, "tools[0].type", "only function"),
])
def test_mistakes_name_the_field(tools: Any, choice: Any, field: str, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        plan(tools, choice, None, AgentSettings(), None)
    assert err.value.field == field and message in str(err.value)


def test_assistant_calls_reach_templates_as_objects() -> None:
    m = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": '{"a": [1]}'}}, {"id": "d", "type": "function", "function": {
            "name": "g", "arguments": ""}}]}
    out = template_message(3, m)
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{"a": [1]}, {}]
    assert m["tool_calls"][0]["function"]["arguments"] == '{"a": [1]}'  # type: ignore
    with pytest.raises(ValidationError) as err:
        template_message(3, {"role": "assistant", "tool_calls": [{"function": {"name": 1}}]})
    assert err.value.field == "messages[3].tool_calls[0].function"


@pytest.fixture(scope="module")
def compiler() -> Compiler:
    return Compiler(Tokenizer.from_dir(str(sentencepiece_dir())), 32000)


def accepts(compiler: Compiler, lark: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(compiler.ll_tokenizer,
                                   llguidance.LLMatcher.grammar_from_lark(lark))
    ok = matcher.consume_tokens(compiler.tok.encode(text, add_special_tokens=False))
    return bool(ok) and matcher.is_accepting()


SCHEMA = GuidedSpec(SpecKind.JSON_SCHEMA, json.dumps({
    "type": "object", "properties": {"a": {"type": "integer"},
                                     "why": {"type": "string", "description": "x ::= y"}},
    "required": ["a"]}), field="guided_json")


@pytest.mark.parametrize("spec, start, good, bad", [
    (SCHEMA, Start.THOUGHT, ['Let me see </think>\n\n{"a": 1}', '</think>{"a":2}'],
     ['a</think>b</think>{"a": 1}', '{"a": 1}', 'x</think>{"b": 1}']),
    (SCHEMA, Start.AUTO, ['{"a": 1}', '<think>hm</think>\n{"a": 1}'], ['hm{"a": 1}']),
    (GuidedSpec(SpecKind.REGEX, r"https?://[a-z]+\.com/[0-9]{2}", field="guided_regex"),
     Start.THOUGHT, ["x</think>http://ab.com/12"], ["x</think>ftp://ab.com/12"]),
    (GuidedSpec(SpecKind.CHOICE, choices=("yes", 'no "way"'), field="guided_choice"),
     Start.THOUGHT, ["x</think>yes", 'x</think> no "way"'], ["x</think>maybe"]),
    (GuidedSpec(SpecKind.JSON_OBJECT, field="response_format"), Start.THOUGHT,
     ['x</think>{"k": [1, {"j": null}]}'], ["x</think>[1]"]),
])
def test_constraints_apply_after_the_thought(compiler: Compiler, spec: GuidedSpec,
                                             start: Start, good: list[str],
                                             bad: list[str]) -> None:
    wrapped = after_thought(spec, start)
    assert (wrapped.kind, wrapped.field) == (SpecKind.GRAMMAR, spec.field)
    lark = compiler.compile_grammar(wrapped.value, "key").lark
    assert [accepts(compiler, lark, t) for t in good] == [True] * len(good)
    assert [accepts(compiler, lark, t) for t in bad] == [False] * len(bad)


def test_a_closed_thought_keeps_the_constraint_and_grammars_are_refused() -> None:
    assert after_thought(SCHEMA, Start.CONTENT) is SCHEMA
    grammar = GuidedSpec(SpecKind.GRAMMAR, 'root ::= "a"', field="guided_grammar")
    with pytest.raises(ValidationError) as err:
        after_thought(grammar, Start.THOUGHT)
    assert err.value.field == "guided_grammar" and "--reasoning-parser" in str(err.value)


def test_tools_select_the_tool_use_template_and_an_override_wins(
        tmp_path: pathlib.Path) -> None:
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    folder = tmp_path / "model"
    (folder / "chat_templates").mkdir(parents=True)
    (folder / "chat_templates" / "default.jinja").write_text("plain")
    (folder / "chat_templates" / "tool_use.jinja").write_text(
        "tools:{% for t in tools %}{{ t.function.name }}{% endfor %}")
    template = ChatTemplate.load(str(folder), tok)
    assert template is not None
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "plain"
    assert template.render(messages, tools=[WEATHER]) == "tools:get_weather"
    override = tmp_path / "mine.jinja"
    override.write_text("mine")
    mine = ChatTemplate.load(str(folder), tok, str(override))
    assert mine is not None and mine.render(messages, tools=[WEATHER]) == "mine"
    assert template_source("{{ messages }}") == "{{ messages }}"
    with pytest.raises(FileNotFoundError):
        template_source(str(tmp_path / "missing.jinja"))
