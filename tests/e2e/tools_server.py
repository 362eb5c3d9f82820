"""The server the tool-calling end-to-end modules share (tests/e2e/test_openai_agents.py,
tests/e2e/test_anthropic.py): the tiny model behind --enable-auto-tool-choice
--tool-call-parser hermes and a ChatML template with tools.  Started once per session
(tests/e2e/conftest.py): its modules read answers, never the server's counters."""
from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.e2e.server import Server, running

MODEL = "tiny-agents"
# Qwen 2.5's way of showing tools and calls, in short: the calls' arguments must reach it
# as objects (tojson), and tool results come back as <tool_response> turns.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}</tools>

For each call, return <tool_call>{"name": <function-name>, "arguments": <args>}</tool_call>
<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tools_server(model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("template") / "chatml_tools.jinja"
    template.write_text(TEMPLATE)
    yield from running(str(model_dir), "--served-model-name", MODEL,
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--chat-template", str(template), http=True)
