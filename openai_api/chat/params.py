"""OpenAI request parameters → the engine's `SamplingParams` / `OutputOptions`.

The same `frontend.validation.ValidatedRequest` the gRPC service builds, under the same
`Limits` (stop sequences, top-n, repetition penalty, the server's max_new_tokens cap, the
model length), so a parameter means the same over both APIs. Every rejection is a
`ValidationError` naming the OpenAI parameter and the limit; the app answers it with a 400.

Defaults are OpenAI's: temperature 1 (sampling), the stop string left out of the text, and
without `max_tokens` a completion gets the server's `--default-max-new-tokens` (OpenAI: 16)
while a chat answer may run to the end of the context, capped by `--max-new-tokens`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass

from tandem_serve.frontend.validation import (
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCE_BYTES,
    MAX_STOP_SEQUENCES,
    MAX_TOP_N_TOKENS,
    Limits,
    ValidatedRequest,
    ValidationError,
    check_priority,
    check_prompt,
)
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.openai_api.protocol import ChatCompletionRequest, CommonRequest, CompletionRequest
from tandem_serve.proto.request_params import OutputOptions, SamplingParams

MAX_N = 128  # OpenAI's limit on choices per request
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence_penalty / frequency_penalty
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # int64 or uint64, as clients send them
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_LOGIT_BIAS = 300  # OpenAI's limit on biased tokens per request


@dataclass
class Params:
    """A validated request before its prompts are known: `for_prompt` finishes one."""

    req: ValidatedRequest  # sampling.max_new_tokens is set per prompt
    n: int
    seed: int | None  # the request's seed; choice j samples with seed + j
    max_tokens: int | None  # asked for explicitly
    max_tokens_field: str
    chat: bool
    guided: GuidedSpec | None


def _finite(field: str, value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise ValidationError(field, f"must be a finite number, got {value}")
    return value


def _in_range(field: str, value: float, low: float, high: float) -> float:
    _finite(field, value)
    if not low <= value <= high:
        raise ValidationError(field, f"must be in [{low:g}, {high:g}], got {value:g}")
    return value


def _unsupported(field: str, why: str) -> ValidationError:
    return ValidationError(field, f"not supported by this server ({why})")


def check_unsupported(body: CommonRequest) -> None:
    """OpenAI fields this server cannot honour pass only at their neutral values."""
    if body.no_stop_trim:
        raise _unsupported("no_stop_trim", "only false; include_stop_str_in_output keeps a "
                                           "stop string in the text")
    if body.return_hidden_states:
        raise _unsupported("return_hidden_states", "only false")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise _unsupported("suffix", "insertion is not supported; leave it unset")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "only 1; use n for several choices")
    if not isinstance(body, ChatCompletionRequest):
        return
    # tools / tool_choice: openai_api/agents/tools.py; the deprecated functions API is not served.
    if body.functions:
        raise _unsupported("functions", "the deprecated form of tool calling; use tools")
    if body.function_call not in (None, "none"):
        raise _unsupported("function_call", "the deprecated form of tool calling; use "
                                            "tool_choice")
    for name in ("audio", "prediction", "reasoning_effort", "metadata", "web_search_options"):
        if getattr(body, name) is not None:
            raise _unsupported(name, "leave it unset")
    if body.modalities not in (None, ["text"]):
        raise _unsupported("modalities", "text only")
    if body.store:
        raise _unsupported("store", "completions are not stored")
    if body.service_tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "only 'auto' or 'default'")


def validate(body: CommonRequest, limits: Limits) -> Params:
    check_unsupported(body)
    chat = isinstance(body, ChatCompletionRequest)
    n = body.n
    if not 1 <= n <= MAX_N:
        raise ValidationError("n", f"must be in [1, {MAX_N}], got {n}")
    if body.stream_options is not None and not body.stream:
        raise ValidationError("stream_options", "only allowed with stream: true")
    if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
        raise ValidationError("seed", f"must be a 64-bit integer, got {body.seed}")
    max_field, max_tokens = _max_tokens(body, limits)
    sampling = _sampling(body, limits)
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise ValidationError("min_tokens", f"must be <= {max_field} ({max_tokens}), "
                                            f"got {body.min_tokens}")
    options = _options(body)
    _logprobs(body, sampling, options)
    return Params(
        req=ValidatedRequest(sampling=sampling, options=options, time_limit=None,
                             truncate_input_tokens=0, input_text=False, input_tokens=False,
                             seed_returned=0),
        n=n, seed=body.seed, max_tokens=max_tokens, max_tokens_field=max_field, chat=chat,
        guided=guided_spec(body))


def _max_tokens(body: CommonRequest, limits: Limits) -> tuple[str, int | None]:
    field, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        if value is not None and value != body.max_completion_tokens:
            raise ValidationError("max_tokens", f"differs from max_completion_tokens "
                                                f"({body.max_completion_tokens}); set one")
        field, value = "max_completion_tokens", body.max_completion_tokens
    if value is not None and not 1 <= value <= limits.max_new_tokens:
        raise ValidationError(field, f"must be in [1, {limits.max_new_tokens}] (the server's "
                                     f"--max-new-tokens), got {value}")
    if body.min_tokens < 0:
        raise ValidationError("min_tokens", f"must be >= 0, got {body.min_tokens}")
    return field, value


def _sampling(body: CommonRequest, limits: Limits) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    _finite("temperature", temperature)
    if temperature < 0:
        raise ValidationError("temperature", f"must be >= 0, got {temperature:g}")
    top_p = 1.0 if body.top_p is None else _finite("top_p", body.top_p)
    if not 0 < top_p <= 1:
        raise ValidationError("top_p", f"must be in (0, 1], got {top_p:g}")
    top_k = body.top_k or 0
    if top_k < -1 or top_k > limits.vocab_size:
        raise ValidationError("top_k", f"must be -1 or 0 (off) or in [1, {limits.vocab_size}] "
                                       f"(the vocabulary size), got {top_k}")
    min_p = _in_range("min_p", body.min_p or 0.0, 0.0, 1.0)
    presence = _in_range("presence_penalty", body.presence_penalty or 0.0, *PENALTY_RANGE)
    frequency = _in_range("frequency_penalty", body.frequency_penalty or 0.0, *PENALTY_RANGE)
    rp = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    _finite("repetition_penalty", rp)
    if not 0 < rp <= MAX_REPETITION_PENALTY:
        raise ValidationError("repetition_penalty",
                              f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {rp:g}")
    stop_ids = list(body.stop_token_ids or ())
    for i, t in enumerate(stop_ids):
        if not 0 <= t < limits.vocab_size:
            raise ValidationError(f"stop_token_ids[{i}]",
                                  f"must be in [0, {limits.vocab_size}), got {t}")
    eos = [] if body.ignore_eos else list(limits.eos_token_ids)
    bias = logit_bias(body.logit_bias or {}, limits.vocab_size)
    priority = check_priority(body.priority, limits)
    return SamplingParams(
        temperature=temperature, top_k=max(top_k, 0), top_p=top_p, min_p=min_p,
        repetition_penalty=rp, presence_penalty=presence, frequency_penalty=frequency,
        min_new_tokens=body.min_tokens,
        stop_token_ids=list(dict.fromkeys(eos + stop_ids)),
        logit_bias_ids=list(bias), logit_bias_values=list(bias.values()), priority=priority)


def logit_bias(raw: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias` (token id as a string -> bias) as unique int ids; the gpu worker
    adds each bias to its token's logit before anything else (`gpu_worker.sampling`)."""
    if len(raw) > MAX_LOGIT_BIAS:
        raise ValidationError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(raw)}")
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key.strip())
        except ValueError:
            raise ValidationError("logit_bias", f"keys must be token ids, got {key[:40]!r}"
                                  ) from None
        if not 0 <= token < vocab_size:
            raise ValidationError("logit_bias", f"token id must be in [0, {vocab_size}) (the "
                                                f"vocabulary size), got {token}")
        if token in out:
            raise ValidationError("logit_bias", f"token id {token} appears twice")
        low, high = LOGIT_BIAS_RANGE
        if not low <= value <= high:  # NaN fails too
            raise ValidationError("logit_bias", f"biases must be in [{low:g}, {high:g}], got "
                                                f"{value:g} for token {token}")
        out[token] = float(value)
    return out


def _options(body: CommonRequest) -> OutputOptions:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValidationError("stop", f"at most {MAX_STOP_SEQUENCES} allowed, got {len(stops)}")
    for i, stop in enumerate(stops):
        size = len(stop.encode("utf-8"))
        if not 1 <= size <= MAX_STOP_SEQUENCE_BYTES:
            raise ValidationError(f"stop[{i}]" if isinstance(body.stop, list) else "stop",
                                  f"must be 1 to {MAX_STOP_SEQUENCE_BYTES} UTF-8 bytes, "
                                  f"got {size}")
    return OutputOptions(stop_sequences=stops,
                         include_stop_sequence=body.include_stop_str_in_output,
                         skip_special_tokens=body.skip_special_tokens)


def _logprobs(body: CommonRequest, sampling: SamplingParams, options: OutputOptions) -> None:
    """Completions: `logprobs: N`; chat: `logprobs: true` + `top_logprobs: N`."""
    if isinstance(body, ChatCompletionRequest):
        top, field = body.top_logprobs, "top_logprobs"
        if top is not None and not body.logprobs:
            raise ValidationError("top_logprobs", "needs logprobs: true")
        wanted = body.logprobs
        top = top or 0
    else:
        assert isinstance(body, CompletionRequest)
        field, wanted = "logprobs", body.logprobs is not None
        top = body.logprobs or 0
    if top < 0 or top > MAX_TOP_N_TOKENS:
        raise ValidationError(field, f"must be in [0, {MAX_TOP_N_TOKENS}] (this server's "
                                     f"limit), got {top}")
    if not wanted:
        return
    options.token_details = options.logprobs = True
    options.top_n = top
    sampling.logprobs = True
    sampling.top_n = top
    # Completions with echo return the prompt's logprobs too (the first token has none).
    sampling.prompt_logprobs = isinstance(body, CompletionRequest) and body.echo


def guided_spec(body: CommonRequest) -> GuidedSpec | None:
    """response_format json_object / json_schema, or one vLLM guided_* extension."""
    found: list[GuidedSpec] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(GuidedSpec(SpecKind.JSON_OBJECT, field="response_format"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.json_schema if rf.json_schema is not None else None
        if schema is None:  # OpenAI: the schema is optional; without one, any object
            found.append(GuidedSpec(SpecKind.JSON_OBJECT, field="response_format"))
        else:
            found.append(_schema_spec(schema, "response_format.json_schema.schema"))
    if body.guided_json is not None:
        found.append(_schema_spec(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        if not body.guided_regex:
            raise ValidationError("guided_regex", "must not be empty")
        found.append(GuidedSpec(SpecKind.REGEX, body.guided_regex, field="guided_regex"))
    if body.guided_choice is not None:
        choices = tuple(body.guided_choice)
        if not choices or not all(choices):
            raise ValidationError("guided_choice", "must be a non-empty list of non-empty "
                                                   "strings")
        found.append(GuidedSpec(SpecKind.CHOICE, choices=choices, field="guided_choice"))
    if body.guided_grammar is not None:
        if not body.guided_grammar.strip():
            raise ValidationError("guided_grammar", "must not be empty")
        found.append(GuidedSpec(SpecKind.GRAMMAR, body.guided_grammar, field="guided_grammar"))
    if len(found) > 1:
        raise ValidationError(found[1].field, f"only one constraint per request; "
                                              f"{found[0].field} is set already")
    return found[0] if found else None


def _schema_spec(schema: object, field: str) -> GuidedSpec:
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValidationError(field, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValidationError(field, "must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValidationError(field, f"is not a valid JSON schema: {exc.message}") from None
    return GuidedSpec(SpecKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True), field=field)


def route_guided(req: ValidatedRequest, spec: GuidedSpec | None) -> None:
    """Put the constraint where the gRPC path puts its own: on the `ValidatedRequest`, whose
    compile step (`frontend.frontend.Frontend.compile`) turns it into what the gpu worker steps."""
    req.guided = spec


def for_prompt(p: Params, prompt_len: int, limits: Limits, field: str) -> ValidatedRequest:
    """The request for one prompt: its length checked, max_new_tokens settled."""
    min_new = p.req.sampling.min_new_tokens
    check_prompt(prompt_len, min_new, limits, field)
    room = limits.max_model_len - prompt_len
    if p.max_tokens is not None:
        if p.max_tokens > room:
            raise ValidationError(p.max_tokens_field,
                                  f"prompt ({prompt_len} tokens) + {p.max_tokens_field} "
                                  f"({p.max_tokens}) exceeds the max model length "
                                  f"{limits.max_model_len}")
        max_new = p.max_tokens
    elif p.chat:
        max_new = min(room, limits.max_new_tokens)
    else:
        max_new = min(room, limits.default_max_new_tokens)
    max_new = max(max_new, min_new, 1)
    sampling = dataclasses.replace(p.req.sampling, max_new_tokens=max_new,
                                   stop_token_ids=list(p.req.sampling.stop_token_ids))
    return dataclasses.replace(p.req, sampling=sampling,
                               options=dataclasses.replace(p.req.options))


def choice_seed(p: Params, j: int) -> int:
    """Choice j of a seeded request samples with seed + j (mod 2**64); else its own seed."""
    if p.seed is None:
        return random.getrandbits(63)
    return (p.seed + j) & ((1 << 64) - 1)
