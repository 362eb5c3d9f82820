"""OpenAI parameters onto the engine's SamplingParams / OutputOptions: defaults, mappings, and a
ValidationError naming the parameter (and its limit) for every value the engine cannot do."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tandem_serve.frontend.validation import Limits, ValidationError
from tandem_serve.guided.spec import SpecKind
from tandem_serve.openai_api.chat import params as P
from tandem_serve.openai_api.protocol import ChatCompletionRequest, CompletionRequest

LIMITS = Limits(max_model_len=64, max_new_tokens=32, default_max_new_tokens=8, vocab_size=100,
                eos_token_ids=(2,), include_stop_sequence=True)
CHAT = [{"role": "user", "content": "hi"}]


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **kw)


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=CHAT, **kw)  # type: ignore[arg-type]


def test_openai_defaults() -> None:
    p = P.validate(completion(), LIMITS)
    s, o = p.req.sampling, p.req.options
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (1.0, 1.0, 0, 0.0)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)
    assert s.stop_token_ids == [2]
    assert o.include_stop_sequence is False  # OpenAI leaves the stop string out
    assert not (s.logprobs or o.token_details or s.prompt_logprobs)
    assert p.n == 1 and p.guided is None


def test_mappings() -> None:
    p = P.validate(completion(temperature=0, top_k=-1, min_p=0.1, presence_penalty=0.5,
                              frequency_penalty=-1.0, repetition_penalty=1.2, min_tokens=3,
                              max_tokens=10, stop=["\n", "END"], stop_token_ids=[7],
                              ignore_eos=True, include_stop_str_in_output=True,
                              skip_special_tokens=False, logprobs=3, echo=True), LIMITS)
    s, o = p.req.sampling, p.req.options
    assert s.greedy and s.top_k == 0 and s.min_p == 0.1
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert s.min_new_tokens == 3 and p.max_tokens == 10
    assert s.stop_token_ids == [7]  # ignore_eos: the request's stop ids only
    assert o.stop_sequences == ["\n", "END"] and o.include_stop_sequence
    assert o.skip_special_tokens is False
    assert (s.logprobs, s.top_n, s.prompt_logprobs) == (True, 3, True)
    assert (o.token_details, o.logprobs, o.top_n) == (True, True, 3)
    c = P.validate(chat(logprobs=True, top_logprobs=2, max_completion_tokens=5), LIMITS)
    assert (c.req.sampling.top_n, c.req.sampling.prompt_logprobs) == (2, False)
    assert (c.max_tokens, c.max_tokens_field) == (5, "max_completion_tokens")


def test_max_tokens_per_prompt() -> None:
    # Completions default to --default-max-new-tokens, chat to the rest of the context.
    assert P.for_prompt(P.validate(completion(), LIMITS), 10, LIMITS, "prompt"
                        ).sampling.max_new_tokens == 8
    assert P.for_prompt(P.validate(completion(), LIMITS), 60, LIMITS, "prompt"
                        ).sampling.max_new_tokens == 4
    assert P.for_prompt(P.validate(chat(), LIMITS), 10, LIMITS, "messages"
                        ).sampling.max_new_tokens == 32
    assert P.for_prompt(P.validate(chat(), LIMITS), 50, LIMITS, "messages"
                        ).sampling.max_new_tokens == 14
    with pytest.raises(ValidationError, match=r"max_tokens: prompt \(40 tokens\) \+ max_tokens "
                                              r"\(30\) exceeds the max model length 64"):
        P.for_prompt(P.validate(completion(max_tokens=30), LIMITS), 40, LIMITS, "prompt")
    with pytest.raises(ValidationError, match="prompt: prompt has 64 tokens"):
        P.for_prompt(P.validate(completion(), LIMITS), 64, LIMITS, "prompt")
    with pytest.raises(ValidationError, match=r"prompt\[1\]: must not be empty"):
        P.for_prompt(P.validate(completion(), LIMITS), 0, LIMITS, "prompt[1]")


def test_seeds_per_choice() -> None:
    p = P.validate(completion(seed=5, n=3), LIMITS)
    assert [P.choice_seed(p, j) for j in range(3)] == [5, 6, 7]
    wrap = P.validate(completion(seed=(1 << 64) - 1, n=2), LIMITS)
    assert P.choice_seed(wrap, 1) == 0
    unseeded = P.validate(completion(n=2), LIMITS)
    assert P.choice_seed(unseeded, 0) != P.choice_seed(unseeded, 1)


BAD: list[tuple[str, Any, str]] = [
    ("n", completion(n=0), "n: must be in [1, 128]"),
    ("n", completion(n=129), "got 129"),
    ("temperature", completion(temperature=-0.5), "must be >= 0"),
    ("temperature", completion(temperature=float("nan")), "finite"),
    ("top_p", completion(top_p=0), "must be in (0, 1]"),
    ("top_p", completion(top_p=1.5), "got 1.5"),
    ("top_k", completion(top_k=-2), "vocabulary size"),
    ("top_k", completion(top_k=101), "[1, 100]"),
    ("min_p", completion(min_p=1.5), "[0, 1]"),
    ("presence_penalty", completion(presence_penalty=2.5), "[-2, 2]"),
    ("frequency_penalty", completion(frequency_penalty=-3), "[-2, 2]"),
    ("repetition_penalty", completion(repetition_penalty=0), "(0, 2]"),
    ("repetition_penalty", completion(repetition_penalty=2.5), "(0, 2]"),
    ("max_tokens", completion(max_tokens=0), "[1, 32]"),
    ("max_tokens", completion(max_tokens=33), "--max-new-tokens"),
    ("max_completion_tokens", chat(max_completion_tokens=40), "[1, 32]"),
    ("max_tokens", chat(max_tokens=4, max_completion_tokens=5), "differs"),
    ("min_tokens", completion(min_tokens=-1), ">= 0"),
    ("min_tokens", completion(min_tokens=9, max_tokens=8), "<= max_tokens (8)"),
    ("stop", completion(stop=list("abcdefg")), "at most 6"),
    ("stop", completion(stop=""), "1 to 240 UTF-8 bytes"),
    ("stop[1]", completion(stop=["a", "x" * 241]), "got 241"),
    ("stop_token_ids[0]", completion(stop_token_ids=[100]), "[0, 100)"),
    ("logprobs", completion(logprobs=11), "[0, 10]"),
    ("top_logprobs", chat(logprobs=True, top_logprobs=11), "this server's limit"),
    ("top_logprobs", chat(top_logprobs=2), "needs logprobs: true"),
    ("seed", completion(seed=1 << 64), "64-bit"),
    ("stream_options", completion(stream_options={"include_usage": True}), "stream: true"),
    ("priority", completion(priority=1), "--scheduling-policy priority"),
    ("priority", chat(priority=-3), "must be 0 unless"),
    ("logit_bias", completion(logit_bias={"100": 1.0}), "[0, 100)"),
    ("logit_bias", completion(logit_bias={"-1": 1.0}), "[0, 100)"),
    ("logit_bias", completion(logit_bias={"five": 1.0}), "token ids"),
    ("logit_bias", chat(logit_bias={"5": 100.5}), "[-100, 100]"),
    ("logit_bias", chat(logit_bias={"5": float("nan")}), "[-100, 100]"),
    ("logit_bias", completion(logit_bias={"5": 1.0, "05": 2.0}), "appears twice"),
    ("logit_bias", completion(logit_bias={str(i): 1.0 for i in range(301)}), "at most 300"),
    ("suffix", completion(suffix="end"), "insertion"),
    ("best_of", completion(best_of=2), "use n"),
    ("functions", chat(functions=[{"name": "f"}]), "tool calling"),
    ("audio", chat(audio={"voice": "x"}), "not supported"),
    ("modalities", chat(modalities=["text", "audio"]), "text only"),
    ("store", chat(store=True), "not stored"),
    ("service_tier", chat(service_tier="flex"), "auto"),
    ("reasoning_effort", chat(reasoning_effort="high"), "not supported"),
    ("guided_json", completion(guided_json={"type": "nonsense"}), "not a valid JSON schema"),
    ("guided_json", completion(guided_json="{not json"), "not valid JSON"),
    ("guided_regex", completion(guided_regex=""), "must not be empty"),
    ("guided_choice", completion(guided_choice=[]), "non-empty"),
    ("guided_regex", completion(response_format={"type": "json_object"}, guided_regex="a+"),
     "only one constraint"),
]


@pytest.mark.parametrize("field, body, message", BAD, ids=[f"{f}-{i}" for i, (f, _, _)
                                                           in enumerate(BAD)])
def test_bad_parameters_name_the_field(field: str, body: Any, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        P.validate(body, LIMITS)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    assert message in str(err.value)


def test_logit_bias_travels_as_ids_and_values() -> None:
    p = P.validate(chat(logit_bias={"7": -100, " 3": 2.5, "99": 100}), LIMITS)
    assert p.req.sampling.logit_bias_ids == [7, 3, 99]
    assert p.req.sampling.logit_bias_values == [-100.0, 2.5, 100.0]
    assert P.validate(completion(), LIMITS).req.sampling.logit_bias_ids == []


def test_priority_needs_the_priority_policy() -> None:
    assert P.validate(chat(priority=0), LIMITS).req.sampling.priority == 0
    limits = dataclasses.replace(LIMITS, priority_scheduling=True)
    assert P.validate(chat(priority=-7), limits).req.sampling.priority == -7
    with pytest.raises(ValidationError, match="priority: must be a 32-bit integer"):
        P.validate(completion(priority=1 << 40), limits)


def test_neutral_values_of_unsupported_fields_pass() -> None:
    P.validate(completion(logit_bias={}, suffix="", best_of=1), LIMITS)
    P.validate(chat(tools=[], tool_choice="none", modalities=["text"], store=False,
                    service_tier="auto", parallel_tool_calls=False), LIMITS)


@pytest.mark.parametrize("body, kind, field", [
    (chat(response_format={"type": "json_object"}), SpecKind.JSON_OBJECT, "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}), SpecKind.JSON_SCHEMA,
     "response_format.json_schema.schema"),
    (completion(guided_json='{"type": "integer"}'), SpecKind.JSON_SCHEMA, "guided_json"),
    (completion(guided_regex="[ab]+"), SpecKind.REGEX, "guided_regex"),
    (completion(guided_choice=["yes", "no"]), SpecKind.CHOICE, "guided_choice"),
    (completion(guided_grammar='root ::= "a" | "b"'), SpecKind.GRAMMAR, "guided_grammar"),
])
def test_constraints_become_one_guided_spec(body: Any, kind: SpecKind, field: str) -> None:
    p = P.validate(body, LIMITS)
    assert p.guided is not None and (p.guided.kind, p.guided.field) == (kind, field)
    P.route_guided(p.req, p.guided)  # where the gRPC path puts its own, to be compiled
    assert p.req.guided == p.guided
    assert P.validate(chat(response_format={"type": "text"}), LIMITS).guided is None
