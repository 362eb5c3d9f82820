"""What tools and reasoning change in a chat request: how its output is read (`Output`), what
the chat template gets, and which guided constraint it runs under.

The server's parsers come from its flags (`AgentSettings`); a request's `tools` /
`tool_choice` pick the tool mode (openai_api/agents/tools.py). A constraint (the request's own
`response_format` / `guided_*`, or the one a required or named tool choice needs) applies to
the content after the thought when the server has a reasoning parser (reasoning.after_thought).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.guided.spec import GuidedSpec
from tandem_serve.openai_api.agents.message import Output, ToolMode
from tandem_serve.openai_api.agents.reasoning import (
    ReasoningParser,
    after_thought,
    reasoning_parser,
)
from tandem_serve.openai_api.agents.tool_parsers import tool_parser
from tandem_serve.openai_api.agents.tool_parsers.base import ToolParser
from tandem_serve.openai_api.agents.tools import AgentSettings, ToolPlan, plan, template_message
from tandem_serve.openai_api.protocol import ChatCompletionRequest
from tandem_serve.proto.request_params import OutputOptions


@dataclass
class ChatPlan:
    tools: ToolPlan
    guided: GuidedSpec | None  # before the reasoning parser's say


class Agents:
    def __init__(self, settings: AgentSettings | None = None) -> None:
        self.settings = settings or AgentSettings()
        self.tool_parser: ToolParser | None = \
            tool_parser(self.settings.tool_parser) if self.settings.tool_parser else None
        self.reasoning: ReasoningParser | None = \
            reasoning_parser(self.settings.reasoning_parser) \
            if self.settings.reasoning_parser else None

    def plan(self, body: ChatCompletionRequest, guided: GuidedSpec | None) -> ChatPlan:
        if self.reasoning is not None:
            # sglang's switches (sglang-router sends both true): with a parser, false would
            # ask for the thought inside the content, or sent whole at the end.
            for name in ("separate_reasoning", "stream_reasoning"):
                if not getattr(body, name):
                    raise ValidationError(name, "must be true with --reasoning-parser (the "
                                                "thought is always split and streamed)")
        tools = plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.settings,
                     self.tool_parser)
        if tools.guided is not None and guided is not None:
            raise ValidationError("tool_choice", f"{body.tool_choice!r} constrains the output "
                                                 f"already; drop {guided.field}")
        return ChatPlan(tools, tools.guided or guided)

    @staticmethod
    def messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [template_message(i, m) for i, m in enumerate(messages)]

    def output(self, chat: ChatPlan, prompt: str) -> Output | None:
        """How the choices read their text; None: plain content, as without tools."""
        if chat.tools.mode == ToolMode.NONE and self.reasoning is None:
            return None
        start = self.reasoning.start(prompt) if self.reasoning is not None else None
        new_id = self.tool_parser.new_id if self.tool_parser is not None else None
        out = Output(chat.tools.mode, chat.tools.parser, new_id, chat.tools.max_calls,
                     self.reasoning)
        if start is not None:
            out.start = start
        return out

    @staticmethod
    def keep_special_tokens(body: ChatCompletionRequest, output: Output | None,
                            options: OutputOptions, eos_texts: tuple[str, ...]) -> None:
        """A parser whose marker is a special token reads text that keeps them, unless the
        request said otherwise; the EOS token's text then ends the output, and is cut."""
        parser = output.parser if output is not None else None
        if output is None or parser is None or output.mode != ToolMode.AUTO \
                or not parser.keeps_special_tokens \
                or "skip_special_tokens" in body.model_fields_set:
            return
        options.skip_special_tokens = False
        output.eos_texts = eos_texts

    def guided(self, chat: ChatPlan, output: Output | None) -> GuidedSpec | None:
        if chat.guided is None or output is None or output.reasoning is None:
            return chat.guided
        return after_thought(chat.guided, output.start)
