"""TGIS request parameters → the frontend's `ValidatedRequest` (`SamplingParams`,
`OutputOptions`).

Every rejection names the field and the limit; the gRPC layer turns `ValidationError` into
INVALID_ARGUMENT and `UnsupportedError` into UNIMPLEMENTED.
"""
from __future__ import annotations

import math
import random

from tandem_serve.frontend.validation import (
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCE_BYTES,
    MAX_STOP_SEQUENCES,
    MAX_TOP_N_TOKENS,
    Limits,
    ValidatedRequest,
    ValidationError,
    capped,
    shown,
)
from tandem_serve.guided.forms import FormError, parse_schema
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.proto.request_params import OutputOptions, SamplingParams

LENGTH_PENALTY_DECAY_RANGE = (1.0, 10.0)
# A constraint's text (regex, schema, grammar, all choices together); compiling a long one
# can take long, and the limit bounds what one request can make the compile worker do.
MAX_GUIDED_BYTES = 64 << 10
_GUIDED_KINDS = {"regex": SpecKind.REGEX, "json_schema": SpecKind.JSON_SCHEMA,
                 "grammar": SpecKind.GRAMMAR}


class UnsupportedError(ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(capped(message))


def _finite(field: str, value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise ValidationError(field, f"must be a finite number, got {value}")
    return value


def check_unsupported(request: pb.SingleGenerationRequest | pb.BatchedGenerationRequest
                      | pb.BatchedTokenizeRequest) -> None:
    """Prompt-tuning prefixes and LoRA adapters: this server has neither."""
    for name in ("prefix_id", "adapter_id"):
        value = getattr(request, name)
        # An explicitly empty id names nothing, so clients that always set the field still work.
        if request.HasField(name) and value:
            kind = "prompt-tuning prefixes" if name == "prefix_id" else "adapters"
            raise UnsupportedError(f"{name}: {kind} are not supported by this server "
                                   f"(got {shown(value)}); leave {name} unset")


def validate_params(params: pb.Parameters, limits: Limits) -> ValidatedRequest:
    guided = validate_guided(params.decoding)
    sampling = _sampling(params, limits)
    options = _options(params, limits)
    r = params.response
    detail = r.token_logprobs or r.token_ranks or r.top_n_tokens > 0
    prompt_detail = r.input_tokens and detail
    sampling.logprobs = options.logprobs or options.ranks
    # top_n_tokens applies to the input tokens too; the worker computes prompt and generated
    # alternatives with the same n.
    sampling.top_n = r.top_n_tokens if (r.generated_tokens or prompt_detail) else 0
    sampling.prompt_logprobs = prompt_detail
    stopping = params.stopping
    return ValidatedRequest(
        sampling=sampling, options=options,
        time_limit=stopping.time_limit_millis / 1000.0 if stopping.time_limit_millis else None,
        truncate_input_tokens=params.truncate_input_tokens,
        input_text=r.input_text, input_tokens=r.input_tokens,
        seed_returned=0 if sampling.greedy else sampling.seed,
        input_logprobs=prompt_detail and r.token_logprobs,
        input_ranks=prompt_detail and r.token_ranks,
        input_top_n=r.top_n_tokens if prompt_detail else 0, guided=guided)


def validate_guided(decoding: pb.DecodingParameters) -> GuidedSpec | None:
    """The `guided` oneof as a spec to compile; None for none or format=TEXT (plain text)."""
    which = decoding.WhichOneof("guided")
    if which is None:
        return None
    field = f"params.decoding.{which}"
    if which == "format":
        if decoding.format == pb.DecodingParameters.JSON:
            return GuidedSpec(SpecKind.JSON_OBJECT, field=field)
        return None
    if which == "choice":
        choices = tuple(decoding.choice.choices)
        if len(choices) < 2:
            raise ValidationError(f"{field}.choices",
                                  f"at least 2 choices are needed, got {len(choices)}")
        _check_size(f"{field}.choices", sum(len(c.encode("utf-8")) for c in choices))
        return GuidedSpec(SpecKind.CHOICE, choices=choices, field=field)
    text: str = getattr(decoding, which)
    if not text:
        raise ValidationError(field, "must not be empty")
    _check_size(field, len(text.encode("utf-8")))
    if which == "json_schema":
        try:
            parse_schema(text)
        except FormError as e:
            raise ValidationError(field, str(e)) from None
    return GuidedSpec(_GUIDED_KINDS[which], value=text, field=field)


def _check_size(field: str, size: int) -> None:
    if size > MAX_GUIDED_BYTES:
        raise ValidationError(field, f"must be at most {MAX_GUIDED_BYTES} UTF-8 bytes, got {size}")


def _sampling(params: pb.Parameters, limits: Limits) -> SamplingParams:
    s = params.sampling
    if params.method not in pb.DecodingMethod.values():
        # proto3 enums are open: a newer client's method must not quietly run as greedy.
        raise ValidationError("params.method", f"unknown decoding method {params.method}; "
                              "must be GREEDY (0) or SAMPLE (1)")
    sampled = params.method == pb.SAMPLE
    temperature = 1.0
    if s.HasField("temperature"):
        temperature = _finite("params.sampling.temperature", s.temperature)
        if temperature < 0:
            raise ValidationError("params.sampling.temperature",
                                  f"must be >= 0, got {temperature:g}")
    if not sampled:
        temperature = 0.0
    top_p = _finite("params.sampling.top_p", s.top_p)
    if not 0.0 <= top_p <= 1.0:
        raise ValidationError("params.sampling.top_p", f"must be in [0, 1], got {top_p:g}")
    typical_p = _finite("params.sampling.typical_p", s.typical_p)
    if not 0.0 <= typical_p <= 1.0:
        raise ValidationError("params.sampling.typical_p",
                              f"must be in [0, 1], got {typical_p:g}")
    # top_k < 0 cannot arrive: the field is a uint32 on the wire.
    if s.top_k > limits.vocab_size:
        raise ValidationError("params.sampling.top_k",
                              f"must be <= the vocabulary size {limits.vocab_size}, "
                              f"got {s.top_k}")
    rp = _finite("params.decoding.repetition_penalty", params.decoding.repetition_penalty)
    if rp < 0 or rp > MAX_REPETITION_PENALTY:
        raise ValidationError("params.decoding.repetition_penalty",
                              f"must be in (0, {MAX_REPETITION_PENALTY:g}] (0 = unset), got {rp:g}")
    lp_start, lp_decay = 0, 1.0
    if params.decoding.HasField("length_penalty"):
        lp = params.decoding.length_penalty
        lp_decay = _finite("params.decoding.length_penalty.decay_factor", lp.decay_factor)
        lo, hi = LENGTH_PENALTY_DECAY_RANGE
        if not lo <= lp_decay <= hi:
            raise ValidationError("params.decoding.length_penalty.decay_factor",
                                  f"must be in [{lo:g}, {hi:g}], got {lp_decay:g}")
        lp_start = lp.start_index
    max_new, min_new = _lengths(params.stopping, limits)
    seed = s.seed if s.HasField("seed") else random.getrandbits(63)
    return SamplingParams(
        temperature=temperature, top_k=s.top_k, top_p=top_p if 0 < top_p < 1 else 1.0,
        typical_p=typical_p if 0 < typical_p < 1 else 1.0,
        repetition_penalty=rp if rp > 0 else 1.0, seed=seed,
        max_new_tokens=max_new, min_new_tokens=min_new,
        stop_token_ids=list(limits.eos_token_ids),
        length_penalty_start=lp_start, length_penalty_decay=lp_decay)


def _lengths(stopping: pb.StoppingCriteria, limits: Limits) -> tuple[int, int]:
    max_new = stopping.max_new_tokens or limits.default_max_new_tokens
    if max_new > limits.max_new_tokens:
        raise ValidationError("params.stopping.max_new_tokens",
                              f"must be <= {limits.max_new_tokens}, got {max_new}")
    if stopping.min_new_tokens > max_new:
        raise ValidationError("params.stopping.min_new_tokens",
                              f"must be <= max_new_tokens ({max_new}), "
                              f"got {stopping.min_new_tokens}")
    return max_new, stopping.min_new_tokens


def _options(params: pb.Parameters, limits: Limits) -> OutputOptions:
    stops = list(params.stopping.stop_sequences)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValidationError("params.stopping.stop_sequences",
                              f"at most {MAX_STOP_SEQUENCES} allowed, got {len(stops)}")
    for i, stop in enumerate(stops):
        size = len(stop.encode("utf-8"))
        if not 1 <= size <= MAX_STOP_SEQUENCE_BYTES:
            raise ValidationError(f"params.stopping.stop_sequences[{i}]",
                                  f"must be 1 to {MAX_STOP_SEQUENCE_BYTES} UTF-8 bytes, "
                                  f"got {size}")
    r = params.response
    if r.top_n_tokens > MAX_TOP_N_TOKENS:
        raise ValidationError("params.response.top_n_tokens",
                              f"must be <= {MAX_TOP_N_TOKENS}, got {r.top_n_tokens}")
    detail = r.token_logprobs or r.token_ranks or r.top_n_tokens > 0
    if detail and not (r.generated_tokens or r.input_tokens):
        raise ValidationError("params.response",
                              "token_logprobs, token_ranks and top_n_tokens require "
                              "generated_tokens or input_tokens")
    include = params.stopping.include_stop_sequence \
        if params.stopping.HasField("include_stop_sequence") else limits.include_stop_sequence
    return OutputOptions(
        stop_sequences=stops, include_stop_sequence=include,
        token_details=r.generated_tokens, logprobs=r.token_logprobs and r.generated_tokens,
        ranks=r.token_ranks and r.generated_tokens,
        top_n=r.top_n_tokens if r.generated_tokens else 0)
