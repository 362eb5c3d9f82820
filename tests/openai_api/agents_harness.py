"""An HTTP app over a scripted engine that writes whatever output a test names: tool calls,
thoughts, JSON. The chat template shows what it was given (tools, calls, results, kwargs),
and the engine keeps every prompt it saw and every constraint compiled for it."""
from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

from tandem_serve.frontend.frontend import Frontend
from tandem_serve.frontend.validation import Limits
from tandem_serve.guided.spec import GuidedSpec
from tandem_serve.openai_api.agents.tools import AgentSettings
from tandem_serve.openai_api.app import build_app
from tandem_serve.openai_api.chat.chat_template import ChatTemplate
from tandem_serve.openai_api.chat.serving import Serving
from tandem_serve.proto.guided_messages import GuidedGrammar
from tandem_serve.proto.request_params import FinishReason, OutputOptions, SamplingParams
from tandem_serve.proto.token_messages import OutputDelta
from tests.openai_api.http_thread import ThreadedServer, tok

LIMITS = Limits(max_model_len=2048, max_new_tokens=512, default_max_new_tokens=16,
                vocab_size=32000, eos_token_ids=(2,), include_stop_sequence=True)
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
    "city={{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if tools %}[tools{% for t in tools %} {{ t.function.name }}{% endfor %}]{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# What the model writes when the last user message says SCRIPT:<name>.
SCRIPTS = {
    "hello": "Hello there! How can I help?",
    "weather": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "two": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
           '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "think": "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.",
    "think_call": '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": '
                  '"get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "required": '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                '"celsius"}}, {"name": "get_time", "parameters": {}}]',
    "named": '{"city": "Paris", "unit": "celsius"}',
    # With special tokens kept, the EOS token's text ends the output.
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>',
}
PIECE = 3  # characters per delta: calls and markers arrive cut up


class ScriptedEngine:
    def __init__(self) -> None:
        self.ids = 0
        self.prompts: list[str] = []
        self.options: list[OutputOptions] = []

    def new_request_id(self) -> int:
        self.ids += 1
        return self.ids

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       options: OutputOptions, deadline: float | None = None, name: str = "",
                       request_id: int | None = None, arrived: float | None = None,
                       guided: object = None, adapter_id: str = ""
                       ) -> AsyncIterator[OutputDelta]:
        prompt = tok().decode(prompt_ids)
        self.prompts.append(prompt)
        self.options.append(options)
        keys = re.findall(r"SCRIPT:([a-z_]+)", prompt)
        key = keys[-1] if keys else "hello"
        text = SCRIPTS[key]
        pieces = [text[i:i + PIECE] for i in range(0, len(text), PIECE)]
        n = min(len(pieces), sampling.max_new_tokens)
        for i in range(n):
            await asyncio.sleep(0)
            finish = FinishReason.NOT_FINISHED
            if i == n - 1:
                finish = FinishReason.EOS_TOKEN if n == len(pieces) else FinishReason.MAX_TOKENS
            yield OutputDelta(request_id or 0, pieces[i], i + 1, [100 + i],
                              finish_reason=finish)


class StubCompiler:
    """Keeps each constraint it is asked for; the scripted engine ignores them."""

    def __init__(self) -> None:
        self.specs: list[GuidedSpec] = []

    async def compile(self, spec: GuidedSpec) -> GuidedGrammar:
        self.specs.append(spec)
        return GuidedGrammar(grammar_id=f"g{len(self.specs)}", lark=spec.value)


class AgentApp:
    def __init__(self, settings: AgentSettings | None) -> None:
        self.engine = ScriptedEngine()
        self.compiler = StubCompiler()
        self.frontend = Frontend(self.engine, tok())  # type: ignore[arg-type]
        self.frontend.guided = self.compiler  # type: ignore[assignment]
        self.frontend.limits, self.frontend.serving = LIMITS, True
        template = ChatTemplate(TEMPLATE, tok().special_tokens_map)
        self.http = ThreadedServer(build_app(Serving(self.frontend, ("tiny",), template, settings)))
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()


def user(script: str, text: str = "") -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{text} SCRIPT:{script}"}]
