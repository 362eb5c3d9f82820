"""`rpc.params`: TGIS parameters → internal params, every limit named in its error."""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from tandem_serve.frontend.validation import Limits, ValidationError
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.params import (
    MAX_GUIDED_BYTES,
    UnsupportedError,
    check_unsupported,
    validate_params,
)

LIMITS = Limits(max_model_len=64, max_new_tokens=32, default_max_new_tokens=20,
                vocab_size=1000, eos_token_ids=(2,), include_stop_sequence=True)


def params(edit: Callable[[pb.Parameters], object] | None = None) -> pb.Parameters:
    p = pb.Parameters()
    if edit is not None:
        edit(p)
    return p


def _set(path: str, value: object) -> Callable[[pb.Parameters], None]:
    def edit(p: pb.Parameters) -> None:
        *parents, name = path.split(".")
        msg: object = p
        for part in parents:
            msg = getattr(msg, part)
        setattr(msg, name, value)
    return edit


def _stops(*stops: str) -> Callable[[pb.Parameters], None]:
    return lambda p: p.stopping.stop_sequences.extend(stops)


def _length_penalty(decay: float) -> Callable[[pb.Parameters], None]:
    def edit(p: pb.Parameters) -> None:
        p.decoding.length_penalty.start_index = 2
        p.decoding.length_penalty.decay_factor = decay
    return edit


def _choices(*choices: str) -> Callable[[pb.Parameters], None]:
    def edit(p: pb.Parameters) -> None:
        p.decoding.choice.SetInParent()  # selects the oneof even with no choices
        p.decoding.choice.choices.extend(choices)
    return edit


def _both(*edits: Callable[[pb.Parameters], None]) -> Callable[[pb.Parameters], None]:
    def edit(p: pb.Parameters) -> None:
        for e in edits:
            e(p)
    return edit


# (edit, field named in the error, a piece of the limit in the message)
BAD = [
    (_set("stopping.max_new_tokens", 33), "params.stopping.max_new_tokens", "<= 32"),
    (_both(_set("stopping.max_new_tokens", 5), _set("stopping.min_new_tokens", 6)),
     "params.stopping.min_new_tokens", "max_new_tokens (5)"),
    (_set("sampling.temperature", -0.5), "params.sampling.temperature", ">= 0"),
    (_set("sampling.temperature", math.nan), "params.sampling.temperature", "finite"),
    (_set("sampling.temperature", math.inf), "params.sampling.temperature", "finite"),
    (_set("sampling.top_p", 1.5), "params.sampling.top_p", "[0, 1]"),
    (_set("sampling.top_p", -0.1), "params.sampling.top_p", "[0, 1]"),
    (_set("sampling.top_p", math.nan), "params.sampling.top_p", "finite"),
    (_set("sampling.typical_p", 1.01), "params.sampling.typical_p", "[0, 1]"),
    (_set("sampling.typical_p", -math.inf), "params.sampling.typical_p", "finite"),
    # top_k < 0 cannot be expressed: the field is a uint32.
    (_set("sampling.top_k", 1001), "params.sampling.top_k", "vocabulary size 1000"),
    (_stops(*"abcdefg"), "params.stopping.stop_sequences", "at most 6"),
    (_stops("ok", ""), "params.stopping.stop_sequences[1]", "1 to 240 UTF-8 bytes"),
    (_stops("x" * 241), "params.stopping.stop_sequences[0]", "got 241"),
    (_stops("é" * 121), "params.stopping.stop_sequences[0]", "got 242"),  # bytes, not chars
    (_both(_set("response.generated_tokens", True), _set("response.top_n_tokens", 11)),
     "params.response.top_n_tokens", "<= 10"),
    (_set("response.token_logprobs", True), "params.response", "require generated_tokens"),
    (_set("response.token_ranks", True), "params.response", "require generated_tokens"),
    (_set("response.top_n_tokens", 2), "params.response", "require generated_tokens"),
    (_set("decoding.repetition_penalty", 3.0), "params.decoding.repetition_penalty", "2"),
    (_set("decoding.repetition_penalty", -1.0), "params.decoding.repetition_penalty", "(0, 2]"),
    (_set("decoding.repetition_penalty", math.nan), "params.decoding.repetition_penalty",
     "finite"),
    (_length_penalty(0.5), "params.decoding.length_penalty.decay_factor", "[1, 10]"),
    (_length_penalty(11.0), "params.decoding.length_penalty.decay_factor", "[1, 10]"),
    (_length_penalty(math.nan), "params.decoding.length_penalty.decay_factor", "finite"),
    (_set("decoding.regex", ""), "params.decoding.regex", "must not be empty"),
    (_set("decoding.regex", "x" * (MAX_GUIDED_BYTES + 1)), "params.decoding.regex",
     f"at most {MAX_GUIDED_BYTES} UTF-8 bytes, got {MAX_GUIDED_BYTES + 1}"),
    (_set("decoding.grammar", ""), "params.decoding.grammar", "must not be empty"),
    (_set("decoding.json_schema", '{"type": '), "params.decoding.json_schema",
     "not valid JSON: Expecting value"),
    (_set("decoding.json_schema", "[1]"), "params.decoding.json_schema",
     "must be a JSON object, got list"),
    (_choices("only one"), "params.decoding.choice.choices",
     "at least 2 choices are needed, got 1"),
    (_choices(), "params.decoding.choice.choices", "at least 2 choices are needed, got 0"),
    (_choices("é" * (MAX_GUIDED_BYTES // 4), "é" * (MAX_GUIDED_BYTES // 4) + "!"),
     "params.decoding.choice.choices", f"got {MAX_GUIDED_BYTES + 1}"),
    # proto3 enums are open: a number the schema does not name must not run as greedy.
    (_set("method", 7), "params.method", "GREEDY (0) or SAMPLE (1)"),
    (_set("method", -1), "params.method", "unknown decoding method -1"),
]


@pytest.mark.parametrize("edit, field, limit", BAD)
def test_each_bad_parameter_names_its_field_and_limit(edit: Callable[[pb.Parameters], None],
                                                      field: str, limit: str) -> None:
    with pytest.raises(ValidationError) as err:
        validate_params(params(edit), LIMITS)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    assert limit in str(err.value)


def test_defaults_are_greedy_with_the_server_defaults() -> None:
    req = validate_params(params(), LIMITS)
    s = req.sampling
    assert s.greedy and req.seed_returned == 0
    assert s.max_new_tokens == 20 and s.min_new_tokens == 0
    assert (s.top_k, s.top_p, s.typical_p, s.repetition_penalty) == (0, 1.0, 1.0, 1.0)
    assert (s.length_penalty_start, s.length_penalty_decay) == (0, 1.0)
    assert s.stop_token_ids == [2]
    assert not (s.logprobs or s.top_n or s.prompt_logprobs)
    assert req.options.include_stop_sequence is True and req.time_limit is None


def test_sampling_parameters_map_through() -> None:
    def edit(p: pb.Parameters) -> None:
        p.method = pb.SAMPLE
        p.sampling.temperature = 0.7
        p.sampling.top_k = 5
        p.sampling.top_p = 0.9
        p.sampling.typical_p = 0.8
        p.sampling.seed = 2**64 - 1  # uint64: the whole range is accepted
        p.decoding.repetition_penalty = 1.3
        p.decoding.length_penalty.start_index = 4
        p.decoding.length_penalty.decay_factor = 1.5
        p.stopping.max_new_tokens = 32
        p.stopping.min_new_tokens = 32
        p.stopping.time_limit_millis = 250
        p.stopping.include_stop_sequence = False
        p.stopping.stop_sequences.extend(["a" * 240, "é" * 120])

    req = validate_params(params(edit), LIMITS)
    s = req.sampling
    assert s.temperature == pytest.approx(0.7) and not s.greedy
    assert (s.top_k, s.max_new_tokens, s.min_new_tokens) == (5, 32, 32)
    assert s.top_p == pytest.approx(0.9) and s.typical_p == pytest.approx(0.8)
    assert s.repetition_penalty == pytest.approx(1.3)
    assert (s.length_penalty_start, s.length_penalty_decay) == (4, 1.5)
    assert s.seed == 2**64 - 1 and req.seed_returned == 2**64 - 1
    assert req.time_limit == pytest.approx(0.25)
    assert req.options.include_stop_sequence is False


def test_unset_temperature_is_one_and_zero_is_greedy() -> None:
    req = validate_params(params(_set("method", pb.SAMPLE)), LIMITS)
    assert req.sampling.temperature == 1.0 and req.seed_returned == req.sampling.seed
    req = validate_params(params(_both(_set("method", pb.SAMPLE),
                                       _set("sampling.temperature", 0.0))), LIMITS)
    assert req.sampling.greedy and req.seed_returned == 0
    # GREEDY ignores the temperature.
    req = validate_params(params(_set("sampling.temperature", 0.5)), LIMITS)
    assert req.sampling.greedy


def test_random_seeds_differ_when_unset() -> None:
    seeds = {validate_params(params(_set("method", pb.SAMPLE)), LIMITS).sampling.seed
             for _ in range(5)}
    assert len(seeds) == 5


def test_off_values_mean_off() -> None:
    def edit(p: pb.Parameters) -> None:
        p.method = pb.SAMPLE
        p.sampling.top_p = 1.0
        p.sampling.typical_p = 0.0
        p.decoding.repetition_penalty = 0.0

    s = validate_params(params(edit), LIMITS).sampling
    assert (s.top_p, s.typical_p, s.repetition_penalty) == (1.0, 1.0, 1.0)


def test_generated_token_detail() -> None:
    def edit(p: pb.Parameters) -> None:
        r = p.response
        r.generated_tokens, r.token_logprobs, r.token_ranks, r.top_n_tokens = True, True, True, 10

    req = validate_params(params(edit), LIMITS)
    o, s = req.options, req.sampling
    assert o.token_details and o.logprobs and o.ranks and o.top_n == 10
    assert s.logprobs and s.top_n == 10 and not s.prompt_logprobs
    assert not (req.input_logprobs or req.input_ranks or req.input_top_n)


def test_input_token_detail_asks_the_worker_for_prompt_logprobs() -> None:
    def edit(p: pb.Parameters) -> None:
        r = p.response
        r.input_tokens, r.token_logprobs, r.top_n_tokens = True, True, 3

    req = validate_params(params(edit), LIMITS)
    s = req.sampling
    assert s.prompt_logprobs and s.top_n == 3  # top_n applies to the prompt too
    assert req.input_tokens and req.input_logprobs and not req.input_ranks
    assert req.input_top_n == 3
    # Not for generated tokens: the postproc worker attaches none.
    assert not (req.options.token_details or req.options.logprobs or req.options.top_n)


def test_input_tokens_without_detail_need_no_prompt_logprobs() -> None:
    req = validate_params(params(_set("response.input_tokens", True)), LIMITS)
    assert req.input_tokens and not req.sampling.prompt_logprobs


@pytest.mark.parametrize("edit, kind, value, choices, field", [
    (_set("decoding.regex", "[0-9]+"), SpecKind.REGEX, "[0-9]+", (), "params.decoding.regex"),
    (_set("decoding.json_schema", '{"type": "integer"}'), SpecKind.JSON_SCHEMA,
     '{"type": "integer"}', (), "params.decoding.json_schema"),
    (_set("decoding.grammar", 'root ::= "a"'), SpecKind.GRAMMAR, 'root ::= "a"', (),
     "params.decoding.grammar"),
    (_set("decoding.format", pb.DecodingParameters.JSON), SpecKind.JSON_OBJECT, "", (),
     "params.decoding.format"),
    (_choices("red", "", "red"), SpecKind.CHOICE, "", ("red", "", "red"),
     "params.decoding.choice"),
])
def test_guided_forms_become_specs_naming_their_field(
        edit: Callable[[pb.Parameters], None], kind: SpecKind, value: str,
        choices: tuple[str, ...], field: str) -> None:
    req = validate_params(params(edit), LIMITS)
    assert req.guided == GuidedSpec(kind, value=value, choices=choices, field=field)
    assert req.sampling.guided_id == ""  # named once compiled


def test_no_guided_and_format_text_are_unconstrained() -> None:
    assert validate_params(params(), LIMITS).guided is None
    text = _set("decoding.format", pb.DecodingParameters.TEXT)
    assert params(text).decoding.WhichOneof("guided") == "format"
    assert validate_params(params(text), LIMITS).guided is None


@pytest.mark.parametrize("request_type", [pb.SingleGenerationRequest,
                                          pb.BatchedGenerationRequest,
                                          pb.BatchedTokenizeRequest])
@pytest.mark.parametrize("name", ["prefix_id", "adapter_id"])
def test_prefixes_and_adapters_are_unimplemented(request_type: type, name: str) -> None:
    check_unsupported(request_type())
    check_unsupported(request_type(**{name: ""}))  # set but naming nothing
    with pytest.raises(UnsupportedError, match=f"{name}: .* not supported"):
        check_unsupported(request_type(**{name: "my-prefix"}))


def test_a_huge_value_is_quoted_in_part_so_the_status_fits_in_grpc_metadata() -> None:
    """Found by fuzzing: a 1 MB adapter_id came back whole in the status message, which the
    client refused (RESOURCE_EXHAUSTED: metadata over its 16 KiB limit)."""
    req = pb.SingleGenerationRequest(adapter_id="a" * (1 << 20))
    with pytest.raises(UnsupportedError) as err:
        check_unsupported(req)
    assert len(str(err.value)) < 300
    assert "(1048576 characters)" in str(err.value)
    with pytest.raises(ValidationError) as bad:
        raise ValidationError("x", "y" * 100_000)
    assert len(str(bad.value)) <= 1003
