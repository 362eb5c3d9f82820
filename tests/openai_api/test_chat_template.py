"""Chat templates render like transformers' apply_chat_template, to the same token ids,
without transformers: where the template comes from, the sandbox's helpers, the options."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tandem_serve.harness.tiny_model import CHAT_TEMPLATE
from tandem_serve.openai_api.chat.chat_template import ChatTemplate, TemplateError, find_template
from tandem_serve.openai_api.chat.logprobs import TokenPieces
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import byte_level_bpe_dir, sentencepiece_dir

# ChatML with the helpers real templates use: namespace, loop controls, tojson with
# options, strftime_now, and the tokens as variables.
CHATML = """{%- set ns = namespace(system=none) %}
{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}
{%- endif %}{% endfor %}
{{- bos_token if bos_token is defined else '' }}
{%- if ns.system is not none %}{{ '<|im_start|>system\\n' + ns.system }}
{%- if tools %}{{ '\\nTools: ' + tools | tojson(indent=2, sort_keys=true) }}{% endif %}
{{- '\\nToday: ' + strftime_now('%Y') + '<|im_end|>\\n' }}{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' %}{% continue %}{% endif %}
{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A story, ä€"}],
    [{"role": "user", "content": "  padded <b>html</b> & \"quotes\"  "}],
]


def model_folder(tmp: Path, tokenizer: Path, template: str, where: str) -> Path:
    out = tmp / "model"
    shutil.copytree(tokenizer, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if where == "jinja":
        (out / "chat_template.jinja").write_text(template)
    elif where == "config":
        config["chat_template"] = template
    elif where == "named":
        config["chat_template"] = [{"name": "default", "template": template},
                                   {"name": "tool_use", "template": "{{ 'tools' }}"}]
    config_path.write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "byte_level_bpe"])
@pytest.mark.parametrize("template, where", [(CHAT_TEMPLATE, "jinja"), (CHATML, "config"),
                                             (CHATML, "named")])
def test_renders_and_tokenizes_like_transformers(tmp_path: Path, tokenizer: str, template: str,
                                                 where: str) -> None:
    from transformers import AutoTokenizer

    src = sentencepiece_dir() if tokenizer == "sentencepiece" else byte_level_bpe_dir()
    folder = model_folder(tmp_path, src, template, where)
    hf = AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_dir(str(folder))
    ours = ChatTemplate.load(str(folder), tok)
    assert ours is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": "é"}}}]
    if where == "named":  # HF would take the "tool_use" template; this server has no tools
        tools = None  # type: ignore[assignment]
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False,
                                          tools=tools)
            got = ours.render(conv, add_generation_prompt=gen, tools=tools)
            assert got == want
            want_ids = hf.apply_chat_template(conv, add_generation_prompt=gen, tools=tools,
                                              return_dict=False)
            assert tok.encode(got, add_special_tokens=False) == list(want_ids)


def test_continue_final_message_like_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = model_folder(tmp_path, sentencepiece_dir(), CHAT_TEMPLATE, "jinja")
    hf = AutoTokenizer.from_pretrained(folder)
    ours = ChatTemplate.load(str(folder), Tokenizer.from_dir(str(folder)))
    assert ours is not None
    conv = [{"role": "user", "content": "Write a poem"},
            {"role": "assistant", "content": "Roses are"}]
    want = hf.apply_chat_template(conv, continue_final_message=True, tokenize=False)
    assert ours.render(conv, add_generation_prompt=False, continue_final_message=True) == want
    assert want.endswith("Roses are")
    with pytest.raises(TemplateError, match="exclude each other"):
        ours.render(conv, add_generation_prompt=True, continue_final_message=True)


def test_template_refusals_and_sandbox(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    ours = ChatTemplate(CHAT_TEMPLATE, tok.special_tokens_map)
    with pytest.raises(TemplateError, match="must alternate"):
        ours.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(TemplateError, match="Only system, user and assistant"):
        ours.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    # The sandbox keeps a template from Python internals.
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(TemplateError):
        escape.render([{"role": "user", "content": "x"}])
    dunder = ChatTemplate("{% set ns = namespace(__x=1) %}{{ ns }}", {})
    with pytest.raises(TemplateError):
        dunder.render([{"role": "user", "content": "x"}])


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, sentencepiece_dir(), "from config", "config")
    assert find_template(str(folder)) == "from config"
    (folder / "chat_template.jinja").write_text("from file")  # the file wins, as in HF
    assert find_template(str(folder)) == "from file"
    bare = tmp_path / "bare"
    shutil.copytree(sentencepiece_dir(), bare)
    assert find_template(str(bare)) is None
    assert ChatTemplate.load(str(bare), Tokenizer.from_dir(str(bare))) is None


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "byte_level_bpe"])
def test_token_pieces_read_as_in_the_text(tokenizer: str) -> None:
    src = sentencepiece_dir() if tokenizer == "sentencepiece" else byte_level_bpe_dir()
    tok = Tokenizer.from_dir(str(src))
    pieces = TokenPieces(tok)
    text = "Hello world, this is\na test of the pieces"
    ids = tok.encode(text, add_special_tokens=False)
    joined = "".join(pieces(i) for i in ids)
    assert joined.strip() == tok.decode(ids).strip()
    assert pieces(ids[1]) == tok.decode(ids[:2])[len(tok.decode(ids[:1])):]
    assert pieces.of_raw(tok.id_to_token(ids[1])) == pieces(ids[1])
