"""Tool-call and reasoning parsers on golden model outputs: the non-streamed parse is the
expected message, and every way of cutting the output into deltas (each split point, one
character at a time, random cuts) streams deltas that add up to exactly that."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_serve.openai_api.agents.message import Output, ToolMode
from tandem_serve.openai_api.agents.reasoning import REASONING_PARSERS, Start, reasoning_parser
from tandem_serve.openai_api.agents.tool_parsers import TOOL_PARSERS, tool_parser
from tandem_serve.openai_api.agents.tool_parsers.base import ToolParser, ToolStream
from tandem_serve.openai_api.agents.tool_parsers.guided import NamedParser, RequiredParser
from tandem_serve.proto.config import REASONING_PARSERS as REASONING_FLAGS
from tandem_serve.proto.config import TOOL_CALL_PARSERS

Calls = list[tuple[str, str]]
WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"q": "a \\"}\\" ]{ <tool_call> [TOOL_CALLS]", "n": [1, {"x": null}], "ü": "日本"}'

GOLDEN: dict[str, list[tuple[str, str, Calls]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>',
         "", [("get_weather", WEATHER)]),
        ("Let me check both.\n<tool_call>\n{\"name\": \"a\", \"arguments\": " + TRICKY +
         "}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n",
         "Let me check both.", [("a", TRICKY), ("b", "{}")]),
        ('<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>', "",
         [("search", '{"q": 1}')]),
        ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n<tool_call>\n{"name": "g", '
         '"arguments": {"b": 2}}', "", [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
        ("Plain text, with a < and a <tool and trailing space \n\n", "Plain text, with a < "
         "and a <tool and trailing space \n\n", []),
        ("<tool_call>not json</tool_call> and text", "<tool_call>not json</tool_call> and "
         "text", []),
        ('<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
        ('<tool_call>{"nam', '<tool_call>{"nam', []),
        ('Before <tool_call>{"name": "f", "arguments": {}}</tool_call> after', "Beforeafter",
         [("f", "{}")]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + WEATHER + "}", "",
         [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "f", "parameters": ' + TRICKY + '}; {"name": "g", '
         '"parameters": {}}', "", [("f", TRICKY), ("g", "{}")]),
        ('  {"name": "f", "arguments": {"a": 1}}\nThat is all.', "That is all.",
         [("f", '{"a": 1}')]),
        ("The answer is {1}.", "The answer is {1}.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("<|python_tag|>", "", []),
        ("  \n", "  \n", []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER + "}]", "",
         [("get_weather", WEATHER)]),
        ('Sure.[TOOL_CALLS][{"name": "f", "arguments": ' + TRICKY + '}, {"name": "g", '
         '"arguments": {}}]', "Sure.", [("f", TRICKY), ("g", "{}")]),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', "",
         [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
        ("No calls [TOOL here", "No calls [TOOL here", []),
        ("[TOOL_CALLS] nonsense", "[TOOL_CALLS] nonsense", []),
        ('[TOOL_CALLS]f{"a": 1} and more', "and more", [("f", '{"a": 1}')]),
    ],
}
CASES = [(name, *case) for name, cases in GOLDEN.items() for case in cases]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, Calls]:
    """Feed the pieces, then end the text; check each call's first delta and join."""
    stream = ToolStream(parser)
    content, calls = "", {}
    for k, piece in enumerate([*pieces, ""]):
        d = stream.feed(piece, final=k == len(pieces))
        content += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name and c.to_json()["type"] == "function"
                calls[c.index] = [c.name, c.arguments]
            else:
                assert set(c.to_json()) == {"index", "function"}
                calls[c.index][1] += c.arguments
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def parsed(parser: ToolParser, text: str) -> tuple[str, Calls]:
    content, calls = parser.parse(text)
    return content, [(c.name, c.arguments) for c in calls]


def test_the_parser_lists_agree_with_the_flags() -> None:
    assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS
    assert tuple(REASONING_PARSERS) == REASONING_FLAGS


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_golden_outputs_parse_and_stream_alike_at_every_split(name: str, text: str,
                                                              content: str,
                                                              calls: Calls) -> None:
    parser = tool_parser(name)
    assert parsed(parser, text) == (content, calls)
    assert streamed(parser, list(text)) == (content, calls)
    for k in range(len(text) + 1):
        assert streamed(parser, [text[:k], text[k:]]) == (content, calls), k


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_cuts_stream_the_same_calls(data: st.DataObject) -> None:
    name, text, content, calls = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert streamed(tool_parser(name), pieces) == (content, calls)


def test_mistral_ids_are_nine_letters_or_digits_and_others_call_ids() -> None:
    _, [call] = tool_parser("mistral").parse('[TOOL_CALLS]f{"a": 1}')
    assert len(call.id) == 9 and call.id.isalnum()
    _, [call] = tool_parser("hermes").parse('<tool_call>{"name": "f"}</tool_call>')
    assert call.id.startswith("call_") and len(call.id) == 29


def test_guided_outputs_stream_like_they_parse() -> None:
    text = '[{"name": "a", "parameters": ' + TRICKY + '}, {"name": "b", "parameters": {}}]'
    want = ("", [("a", TRICKY), ("b", "{}")])
    for k in range(len(text) + 1):
        assert streamed(RequiredParser(), [text[:k], text[k:]]) == want
    named = NamedParser("get_weather")
    assert parsed(named, WEATHER) == ("", [("get_weather", WEATHER)])
    assert streamed(named, list(WEATHER)) == ("", [("get_weather", WEATHER)])
    assert streamed(named, []) == ("", [("get_weather", "")])  # nothing written: no arguments


REASONING = [  # parser, prompt end, output, reasoning, content
    ("deepseek_r1", "<｜Assistant｜>", "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.",
     "\nHmm, 2+2.\n", "\n\nIt is 4."),
    ("deepseek_r1", "<think>\n", "Hmm </thin k></think>4", "Hmm </thin k>", "4"),
    ("deepseek_r1", "assistant\n", "still thinking <", "still thinking <", ""),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nok\n</think>\n\nHi!", "\nok\n", "\n\nHi!"),
    ("qwen3", "<|im_start|>assistant\n", "Hi! No </think> thought here.", "",
     "Hi! No </think> thought here."),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", "",
     "<think>x</think>y"),
    ("qwen3", "assistant\n<think>\n", "opened by the template</think>answer",
     "opened by the template", "answer"),
]


def split_stream(output: Output, pieces: list[str]) -> tuple[str, str]:
    stream = output.stream()
    reasoning = content = ""
    for k, piece in enumerate([*pieces, ""]):
        d = stream.feed(piece, final=k == len(pieces))
        reasoning += d.reasoning
        content += d.content
    return reasoning, content


@pytest.mark.parametrize("name, prompt, text, reasoning, content", REASONING)
def test_reasoning_splits_alike_at_every_split(name: str, prompt: str, text: str,
                                               reasoning: str, content: str) -> None:
    parser = reasoning_parser(name)
    output = Output(reasoning=parser, start=parser.start(prompt))
    message = output.message(text)
    assert (message.reasoning or "", message.content) == (reasoning, content)
    for k in range(len(text) + 1):
        assert split_stream(output, [text[:k], text[k:]]) == (reasoning, content), k
    assert split_stream(output, list(text)) == (reasoning, content)


def test_tool_calls_are_read_from_the_content_after_the_thought() -> None:
    parser = reasoning_parser("qwen3")
    output = Output(ToolMode.AUTO, tool_parser("hermes"), reasoning=parser,
                    start=Start.AUTO)
    text = ('<think>I could write <tool_call>{"name": "no"}</tool_call> here</think>\n\n'
            'Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    message = output.message(text)
    assert message.reasoning == 'I could write <tool_call>{"name": "no"}</tool_call> here'
    assert message.content == "\n\nChecking."
    assert [(c.name, c.arguments) for c in message.calls] == [("f", '{"a": 1}')]
    assert output.finish_reason("stop", True) == "tool_calls"
    assert output.finish_reason("length", True) == "length"
    for k in range(len(text) + 1):
        stream = output.stream()
        got: dict[str, Any] = {"r": "", "c": "", "a": ""}
        for piece, final in ((text[:k], False), (text[k:], False), ("", True)):
            d = stream.feed(piece, final)
            got["r"] += d.reasoning
            got["c"] += d.content
            got["a"] += "".join(c.arguments for c in d.calls)
        assert (got["r"], got["c"], got["a"]) == (message.reasoning, message.content,
                                                  '{"a": 1}')


def test_a_named_call_starts_after_the_thought() -> None:
    parser = reasoning_parser("deepseek_r1")
    output = Output(ToolMode.NAMED, NamedParser("f"), reasoning=parser, start=Start.THOUGHT)
    stream = output.stream()
    kinds = []
    for piece in ["Thinking", " hard</think>", "\n", '{"a"', ": 1}"]:
        d = stream.feed(piece, False)
        kinds += ["reasoning"] * bool(d.reasoning) + ["call"] * bool(d.calls)
    assert kinds == ["reasoning", "reasoning", "call", "call"]
    assert [(c.name, c.arguments) for c in stream.tools.calls] == [("f", '{"a": 1}')]  # type: ignore[union-attr]
