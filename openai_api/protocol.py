"""Request bodies of `/v1/completions` and `/v1/chat/completions` as pydantic models.

Field names and types are OpenAI's, plus the vLLM extensions a vLLM user sends through
`extra_body` (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `return_token_ids`,
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, chat template
options). A field nobody declared is a 400 naming it (`extra="forbid"`): a parameter the
engine would not honour is never dropped silently. OpenAI fields this server cannot honour
are declared so that their neutral values pass; `params.check_unsupported` answers anything
else with a 400 naming them. So are the fields sglang-router adds to every body it forwards
(0.3.2: `no_stop_trim` and `return_hidden_states` on both endpoints, `separate_reasoning` and
`stream_reasoning` on chat), at the values it sends.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False
    # vLLM: every chunk carries the usage so far (clients count tokens per chunk with it).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    name: str = ""
    description: str | None = None
    # `schema` would shadow BaseModel.schema: the JSON key is an alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CommonRequest(Strict):
    """What both endpoints accept."""

    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # goes into the request's log tag
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]
    # vLLM extensions
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # sglang's, added by sglang-router: only false passes (params.check_unsupported)
    no_stop_trim: bool = False
    return_hidden_states: bool = False


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # only empty
    best_of: int | None = None  # only 1


class ChatMessage(BaseModel):
    """Any keys a chat template may read (name, tool_call_id, reasoning_content, ...) pass
    through to it; `content` is a string or a list of {"type": "text", "text": ...} parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI fields that only pass at their neutral value (params.check_unsupported)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    web_search_options: dict[str, Any] | None = None
    # chat template options (vLLM / transformers)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # sglang's, added by sglang-router (both true): without --reasoning-parser either value
    # leaves the answer as it is (as in sglang); with one, false is a 400
    # (`agents.chat_plan.Agents`)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
