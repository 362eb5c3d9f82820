"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` does,
without importing transformers (which imports torch).

Where the template comes from (transformers 5's order): `chat_template.jinja` and
`chat_templates/*.jinja` in the model folder win over the `chat_template` entry of
tokenizer_config.json (a string, or a list of {"name", "template"}); of several named
templates, "default" is used, and "tool_use" for a request with tools when there is one.
`--chat-template` (a file, or the template's text) replaces them all.

How it renders: jinja2's `ImmutableSandboxedEnvironment` (the template is code from the
checkpoint's author; the sandbox keeps it from reaching Python internals) with
`trim_blocks`, `lstrip_blocks` and the loop-controls extension, transformers' `tojson`
(no HTML escaping, with indent / separators / sort_keys), `raise_exception`, `strftime_now`,
and the template variables `messages`, `tools`, `documents`, `add_generation_prompt` and the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...). The rendered text is
tokenized without special tokens: the template writes BOS itself.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem_serve.tokenization.tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
# transformers marks the final message to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception), or failed on it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """transformers' `dict` global: builds dicts, without the type's other attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes (no dunder access)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    return env


def find_templates(model_dir: str) -> dict[str, str]:
    """A model folder's chat templates by name ("default", "tool_use", ...)."""
    root = Path(model_dir)
    named: dict[str, str] = {}
    if (root / CHAT_TEMPLATE_FILE).is_file():
        named["default"] = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (root / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            named.setdefault(path.name.removesuffix(".jinja"), path.read_text(encoding="utf-8"))
    if not named:
        try:
            config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        entry = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(entry, str):
            return {"default": entry}
        if isinstance(entry, list):
            named = {t["name"]: t["template"] for t in entry
                     if isinstance(t, dict) and isinstance(t.get("template"), str)}
    return named


def find_template(model_dir: str) -> str | None:
    """The default chat template of a model folder, or None when it has none."""
    return find_templates(model_dir).get("default")


def template_source(value: str) -> str:
    """`--chat-template`: a file's text, or the template itself when it is one (vLLM's rule:
    a value with jinja markup that names no file)."""
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(mark in value for mark in ("{{", "{%")):
        return value
    raise FileNotFoundError(f"--chat-template {value!r} is neither a file nor a template")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str],
                 tool_use: str | None = None) -> None:
        self.source = source
        self._template = _environment().from_string(source)
        # transformers renders a request with tools through the "tool_use" template if the
        # checkpoint names one.
        self._tool_use = _environment().from_string(tool_use) if tool_use else None
        self._special = dict(special_tokens)

    @classmethod
    def load(cls, model_dir: str, tok: Tokenizer, override: str = "") -> ChatTemplate | None:
        """The checkpoint's templates, or `--chat-template`'s (then for every request)."""
        if override:
            return cls(template_source(override), tok.special_tokens_map)
        named = find_templates(model_dir)
        source = named.get("default")
        return None if source is None else cls(source, tok.special_tokens_map,
                                               named.get("tool_use"))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None,
               kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text, as `apply_chat_template(..., tokenize=False)` renders it."""
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt exclude "
                                "each other; set add_generation_prompt: false")
        # HF drops None-valued keys: templates test for a key, and would print "None".
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        final = ""
        if continue_final_message:
            final, chat[-1] = _tag_final(chat[-1])
        variables = {**self._special, **(kwargs or {})}
        try:
            template = self._tool_use if tools and self._tool_use is not None \
                else self._template
            text = template.render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(str(exc) or type(exc).__name__) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed on these messages: {exc}") from None
        return _cut_at_tag(text, final) if continue_final_message else text


def _tag_final(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return content, {**message, "content": content + _CONTINUE_TAG}
    raise TemplateError("continue_final_message needs the final message's content as text")


def _cut_at_tag(text: str, final: str) -> str:
    """transformers' continue_final_message: the rendered chat up to the final message's end."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TemplateError("continue_final_message: the chat template does not render the "
                            "final message as it was sent")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space
