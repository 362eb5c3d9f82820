"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

    /tokenize    {"prompt": str, "add_special_tokens": true}
                 or {"messages": [...], "add_generation_prompt": true,
                     "continue_final_message": false, "add_special_tokens": false,
                     "tools": [...], "chat_template_kwargs": {...}}
                 (either with "return_token_strs")
              -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [ids]} -> {"prompt": str}

A chat's prompt is rendered exactly as a chat completion renders it (`rendered`: the same
template, messages and tools), so `count` is the `prompt_tokens` that request would use;
`/v1/messages/count_tokens` counts the same way. `token_strs` are the vocabulary's own
strings ("▁Hello", "Ġworld"), as `convert_ids_to_tokens`; detokenize keeps special tokens, as
`tokenizer.decode` does by default.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.chat import params as P
from tandem_serve.openai_api.chat.serving import Prompt, Serving
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.protocol import ChatCompletionRequest, ChatMessage, Strict


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: true for a prompt, false for messages (their template writes BOS), as vLLM
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


async def rendered(serving: Serving, chat: ChatCompletionRequest) -> Prompt:
    """A chat request's prompt as `Serving.begin` renders it, without submitting it."""
    limits = serving.frontend.ready_limits()
    params = P.validate(chat, limits)
    plan = serving.agents.plan(chat, params.guided)
    return await serving.chat_prompt(chat, plan.tools.tools)


async def _ids(serving: Serving, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ValidationError("prompt", "give either prompt or messages")
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return await serving.frontend.encode(body.prompt, add_special_tokens=add)
    chat = ChatCompletionRequest(
        messages=body.messages, tools=body.tools,  # type: ignore[arg-type]
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs)
    prompt = await rendered(serving, chat)
    if body.add_special_tokens:
        return await serving.frontend.encode(prompt.text, add_special_tokens=True)
    return prompt.ids


async def tokenize(serving: Serving, body: TokenizeRequest) -> dict[str, Any]:
    serving.models.resolve(body.model)
    try:
        ids = await _ids(serving, body)
        limits = serving.frontend.ready_limits()
    except ValidationError as exc:
        raise ApiError.bad_parameter(exc) from None
    except EngineError as exc:
        raise ApiError.from_engine(exc) from None
    tok = serving.frontend.tok
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
            "token_strs": [tok.id_to_token(i) for i in ids] if body.return_token_strs
            else None}


def detokenize(serving: Serving, body: DetokenizeRequest) -> dict[str, str]:
    serving.models.resolve(body.model)
    tok = serving.frontend.tok
    size = len(tok)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < size:
            raise ApiError(400, f"tokens[{i}]: token id must be in [0, {size}), got {t}",
                           f"tokens[{i}]", "invalid_parameter")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
