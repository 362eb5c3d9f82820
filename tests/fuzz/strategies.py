"""Hypothesis strategies for fuzzing the public APIs.

gRPC requests are built from `proto/generation.proto`'s own descriptors, so every field of
every request message is covered, including fields added later: scalars by wire type with
their edge values (NaN, ±inf, huge, negative, 0), enums with numbers the schema does not
name (proto3 enums are open), oneofs, proto3 `optional`, repeated and nested messages.  A
draw is either *tame* (values a client would plausibly send, so most requests run and the
generation paths get fuzzed too) or *wild* (edge values everywhere, so most are rejected).

`raw_request` goes below the Python API, which refuses to build some wire messages: it
appends a string field with invalid UTF-8 at any string field's path (stop sequences,
prompts, ids) or sends truncated and random bytes.

`openai_body` (and `responses_body`) draw JSON bodies for the OpenAI-compatible HTTP API
(`/v1/completions`,
`/v1/chat/completions`): well-formed requests with random values, any JSON value in any
field, and bodies that are not objects at all.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from tandem_serve.proto import generation_pb2 as pb

FD = FieldDescriptor
MAX_DEPTH = 4
ONE_MB = 1 << 20

# A 1 MB text costs the server a tokenizer pass of seconds: one request in this many may
# carry huge strings (a quarter of its string fields then are).
HUGE_ONE_IN = 25

WORDS = ("Once upon a time the quick brown fox jumps over lazy dog river stone cloud light "
         "seven orange tiger music . , ! ? \n").split(" ")
ODD_TEXTS = ["", " ", "\n\n", "\x00", "\t", "é", "😀", "\u200b", "\ufffd", "\uffff",
             "<s>", "</s>", "<unk>", "▁", "\U0010ffff", "a" * 241, "é" * 121, "\r\n" * 50]

FLOAT_EDGES = [math.nan, math.inf, -math.inf, -0.0, -1.0, 1e-45, 1e-38, 3.4e38, -3.4e38,
               1e10, 2.0, 1.0000001, 10.0, 10.5, 0.9999999]
INT_EDGES = {
    FD.TYPE_UINT32: [2**32 - 1, 2**31, 2**31 - 1, 65536, 1025, 1000, 257, 11],
    FD.TYPE_UINT64: [2**64 - 1, 2**63, 2**63 - 1, 2**32, 2**53 + 1],
    FD.TYPE_INT32: [-1, -(2**31), 2**31 - 1],
    FD.TYPE_INT64: [-1, -(2**63), 2**63 - 1],
}
INT_RANGE = {
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_INT64: (-(2**63), 2**63 - 1),
}
# Enum numbers the schema does not name (an old or a newer client's values).
UNKNOWN_ENUM_NUMBERS = [-1, 2, 3, 7, 99, 2**31 - 1]
BAD_UTF8 = [b"\xff", b"\xc3", b"abc\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf",
            b"stop\xfe", b"\xe2\x82"]


def _weighted(common: st.SearchStrategy, rare: st.SearchStrategy,
              one_in: int) -> st.SearchStrategy:
    """`rare` about once in `one_in` draws."""
    return chance(1 / one_in).flatmap(lambda r: rare if r else common)


def huge_text() -> st.SearchStrategy[str]:
    return st.sampled_from(["a", "é", "😀 ", "the quick brown fox "]).map(
        lambda unit: unit * (ONE_MB // len(unit.encode())))


def tame_text(max_words: int = 12) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(WORDS), min_size=1, max_size=max_words).map(" ".join)


def wild_text() -> st.SearchStrategy[str]:
    # No lone surrogates: the Python API cannot encode them (raw_request sends bad bytes).
    chars = st.characters(blacklist_categories=("Cs",))
    return st.one_of(st.sampled_from(ODD_TEXTS), st.text(chars, max_size=64),
                     st.text(chars, min_size=200, max_size=400))


def _float(wild: bool) -> st.SearchStrategy[float]:
    tame = st.one_of(st.just(0.0), st.floats(0.0, 1.0, width=32),
                     st.floats(1.0, 2.0, width=32))
    edges = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32))
    return _weighted(tame, edges, 2 if wild else 12)


def _int(ftype: int, wild: bool) -> st.SearchStrategy[int]:
    lo, hi = INT_RANGE[ftype]
    # Small counts keep generation short: most requests ask for a few tokens.
    tame = st.integers(max(lo, 0), 8)
    edges = st.one_of(st.sampled_from(INT_EDGES[ftype]), st.integers(lo, hi))
    return _weighted(tame, edges, 2 if wild else 12)


def _string(wild: bool, huge: bool) -> st.SearchStrategy[str]:
    common = _weighted(tame_text(), wild_text(), 2 if wild else 8)
    return _weighted(common, huge_text(), 4) if huge else common


def _enum(field: FieldDescriptor, wild: bool) -> st.SearchStrategy[int]:
    assert field.enum_type is not None
    known = st.sampled_from([v.number for v in field.enum_type.values])
    return _weighted(known, st.sampled_from(UNKNOWN_ENUM_NUMBERS), 3 if wild else 15)


def scalar(field: FieldDescriptor, wild: bool, huge: bool = False) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return _float(wild)
    if t in INT_RANGE:
        return _int(t, wild)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return _string(wild, huge)
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FD.TYPE_ENUM:
        return _enum(field, wild)
    raise NotImplementedError(f"{field.full_name}: field type {t} has no strategy yet")


# How likely a field is set (tame, wild).  The prompt nearly always, so most tame requests
# get to run; fields that ask for a feature a server may not have (prompt-tuning prefixes,
# adapters) rarely; the rest half the time (unset is the server's default, often the
# interesting case).
INPUT_FIELDS = {"request", "requests", "text"}
FEATURE_FIELDS = {"prefix_id", "adapter_id"}


def _set_chance(name: str, wild: bool) -> float:
    if name in INPUT_FIELDS:
        return 0.7 if wild else 0.97
    if name in FEATURE_FIELDS:
        return 0.25 if wild else 0.05
    return 0.5


def chance(p: float) -> st.SearchStrategy[bool]:
    """True with probability `p` (a seeded Random: hypothesis itself favours edge values)."""
    return st.randoms(use_true_random=True).map(lambda r: r.random() < p)


def _real_oneofs(desc: Descriptor) -> list[list[FieldDescriptor]]:
    """Oneofs with a choice to make (proto3 `optional` makes a synthetic one per field)."""
    return [list(o.fields) for o in desc.oneofs if len(o.fields) > 1]


@st.composite
def fill(draw: st.DrawFn, msg: Message, wild: bool, huge: bool = False,
         depth: int = 0) -> Message:
    """Set a random subset of `msg`'s fields (recursively) and return it."""
    desc = msg.DESCRIPTOR
    chosen_oneof: set[str] = set()
    for members in _real_oneofs(desc):  # a member now and then (guided decoding)
        if draw(chance(0.5 if wild else 0.1)):
            chosen_oneof.add(draw(st.sampled_from(members)).name)
    in_oneof = {f.name for members in _real_oneofs(desc) for f in members}
    for field in desc.fields:
        if field.name in in_oneof and field.name not in chosen_oneof:
            continue
        if field.name not in chosen_oneof and not draw(chance(_set_chance(field.name, wild))):
            continue
        _set_field(draw, msg, field, wild, huge, depth)
    return msg


def _set_field(draw: st.DrawFn, msg: Message, field: FieldDescriptor, wild: bool, huge: bool,
               depth: int) -> None:
    is_message = field.type == FD.TYPE_MESSAGE
    if field.is_repeated:
        most = 12 if wild else 3
        least = 1 if field.name in INPUT_FIELDS and not wild else 0
        count = draw(st.integers(least, most))
        target = getattr(msg, field.name)
        for _ in range(count):
            if is_message:
                if depth < MAX_DEPTH:
                    draw(fill(target.add(), wild, huge, depth + 1))
            else:
                target.append(draw(scalar(field, wild, huge)))
        return
    if is_message:
        sub = getattr(msg, field.name)
        sub.SetInParent()  # present even when no field of it gets set
        if depth < MAX_DEPTH:
            draw(fill(sub, wild, huge, depth + 1))
        return
    setattr(msg, field.name, draw(scalar(field, wild, huge)))


def messages(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Random instances of a generated message class, tame or wild, now and then huge."""
    wild = _weighted(st.just(False), st.just(True), 3)
    huge = _weighted(st.just(False), st.just(True), HUGE_ONE_IN)
    return st.tuples(wild, huge).flatmap(lambda wh: fill(cls(), *wh))


# ---------------------------------------------------------------------- raw wire bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def string_paths(desc: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Every path of fields from `desc` down to a string field."""
    out: list[tuple[FieldDescriptor, ...]] = []
    for field in desc.fields:
        if field.type == FD.TYPE_STRING:
            out.append((field,))
        elif field.type == FD.TYPE_MESSAGE and depth < MAX_DEPTH:
            out += [(field, *rest) for rest in string_paths(field.message_type, depth + 1)]
    return out


def inject(path: tuple[FieldDescriptor, ...], payload: bytes) -> bytes:
    """Wire bytes that, appended to a message, set the string at `path` to `payload`.

    Protobuf merges a repeated occurrence of an embedded message field into the one already
    there (and appends to repeated fields), so this reaches fields of existing submessages.
    """
    data = length_delimited(path[-1].number, payload)
    for field in reversed(path[:-1]):
        data = length_delimited(field.number, data)
    return data


@dataclass(frozen=True)
class RawRequest:
    data: bytes
    how: str  # "bad-utf8 <path>", "truncated", "random", "wrong-wire-type"


@st.composite
def raw_request(draw: st.DrawFn, cls: type[Message]) -> RawRequest:
    """Wire bytes the Python API would not produce: invalid UTF-8, cut or random bytes."""
    base = draw(messages(cls)).SerializeToString()
    kind = draw(st.sampled_from(["bad-utf8", "bad-utf8", "truncated", "random", "wire-type"]))
    if kind == "bad-utf8":
        paths = string_paths(cls.DESCRIPTOR)
        path = draw(st.sampled_from(paths))
        bad = draw(st.sampled_from(BAD_UTF8))
        prefix = draw(st.sampled_from(["", "ok ", "é"])).encode()
        return RawRequest(base + inject(path, prefix + bad),
                          "bad-utf8 " + ".".join(f.name for f in path))
    if kind == "truncated":
        whole = base + inject(draw(st.sampled_from(string_paths(cls.DESCRIPTOR))), b"tail")
        cut = draw(st.integers(1, max(1, len(whole) - 1)))
        return RawRequest(whole[:cut], "truncated")
    if kind == "wire-type":
        # A known field number with the wrong wire type (a varint where a message goes).
        field = draw(st.sampled_from(list(cls.DESCRIPTOR.fields)))
        return RawRequest(base + _varint(field.number << 3 | 0) + _varint(7), "wrong-wire-type")
    return RawRequest(draw(st.binary(min_size=1, max_size=256)), "random")


# ---------------------------------------------------------------------- gRPC calls


@dataclass(frozen=True)
class Method:
    name: str
    request: type[Message]
    response: type[Message]
    streaming: bool

    @property
    def path(self) -> str:
        return f"/fmaas.GenerationService/{self.name}"


METHODS = [
    Method("GenerateStream", pb.SingleGenerationRequest, pb.GenerationResponse, True),
    Method("Generate", pb.BatchedGenerationRequest, pb.BatchedGenerationResponse, False),
    Method("Tokenize", pb.BatchedTokenizeRequest, pb.BatchedTokenizeResponse, False),
    Method("ModelInfo", pb.ModelInfoRequest, pb.ModelInfoResponse, False),
]


@dataclass(frozen=True)
class Call:
    method: Method
    data: bytes
    message: Message | None  # None for raw bytes
    how: str

    def describe(self) -> str:
        shown = str(self.message)[:2000] if self.message is not None else self.data[:200]
        return f"{self.method.name} ({self.how}): {shown!r}"


def _call_of(method: Method, raw: bool) -> st.SearchStrategy[Call]:
    if raw:
        return raw_request(method.request).map(lambda r: Call(method, r.data, None, r.how))
    return messages(method.request).map(
        lambda m: Call(method, m.SerializeToString(), m, "message"))


# Generation gets most of the draws; ModelInfo has little to fuzz.
METHOD_WEIGHTS = {"GenerateStream": 4, "Generate": 3, "Tokenize": 2, "ModelInfo": 1}


def calls(methods: list[Method] = METHODS) -> st.SearchStrategy[Call]:
    """A method and its request: a message from the descriptors, or raw bytes (1 in 4)."""
    weighted = [m for m in methods for _ in range(METHOD_WEIGHTS.get(m.name, 1))]
    return st.tuples(st.sampled_from(weighted), chance(0.25)).flatmap(
        lambda mr: _call_of(*mr))


# ---------------------------------------------------------------------- OpenAI JSON bodies


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
                        st.sampled_from(ODD_TEXTS))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
        max_leaves=12)


def _tame_openai(chat: bool, model: str) -> dict[str, st.SearchStrategy[Any]]:
    text = _weighted(tame_text(), st.one_of(wild_text(), huge_text()), 10)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": text})
    fields: dict[str, st.SearchStrategy[Any]] = {
        "model": _weighted(st.just(model), st.text(max_size=12), 10),
        "max_tokens": st.one_of(st.integers(0, 8), st.sampled_from([-1, 2**31, 10**12])),
        "temperature": st.one_of(st.floats(0, 2), st.sampled_from([-1.0, 1e9])),
        "top_p": st.one_of(st.floats(0, 1), st.sampled_from([0.0, -0.5, 1.5])),
        "top_k": st.integers(-2, 100), "seed": st.one_of(st.integers(0, 2**63), st.just(-1)),
        "stop": st.one_of(st.text(max_size=8), st.lists(st.text(max_size=8), max_size=8)),
        "n": st.integers(-1, 4), "stream": st.booleans(),
        "logprobs": st.one_of(st.booleans(), st.integers(-1, 30)),
        "top_logprobs": st.integers(-1, 30),
        "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
        "repetition_penalty": st.floats(-1, 3), "min_tokens": st.integers(-1, 12),
        "ignore_eos": st.booleans(), "echo": st.booleans(), "user": st.text(max_size=8),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                            {"type": "json_schema"}, {"type": "nope"}]),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        # what sglang-router adds (at false), and their other value
        "no_stop_trim": st.booleans(), "return_hidden_states": st.booleans(),
    }
    if chat:
        turn = st.one_of(message, st.sampled_from(TOOL_TURNS))
        fields["messages"] = st.lists(_weighted(message, turn, 5), min_size=0, max_size=3)
        fields["separate_reasoning"] = st.booleans()
        fields["stream_reasoning"] = st.booleans()
        fields["max_completion_tokens"] = st.integers(-1, 8)
        fields["tools"] = st.lists(st.sampled_from(FUZZ_TOOLS), max_size=3)
        fields["tool_choice"] = st.sampled_from(TOOL_CHOICES)
        fields["parallel_tool_calls"] = st.booleans()
    else:
        fields["prompt"] = st.one_of(text, st.lists(text, max_size=3),
                                     st.lists(st.integers(-5, 40000), max_size=8))
    return fields


# Tools, good and bad (a name with a space, a schema that is not one, a tool type nobody
# serves); schemas stay small so that required and named choices compile in moments.
_CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
         "required": ["city"]}
FUZZ_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": _CITY}},
    {"type": "function", "function": {"name": "now"}},
    {"type": "function", "function": {"name": "bad name"}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}},
    {"type": "web_search"}]
TOOL_CHOICES: list[Any] = [
    "none", "auto", "required", "sometimes", {"type": "function"},
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "nope"}}]
TOOL_TURNS: list[Any] = [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "assistant", "tool_calls": [{"id": "c2", "function": {"arguments": "{no"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
RESPONSE_ITEMS: list[Any] = [
    {"type": "function_call", "call_id": "c1", "name": "get_weather",
     "arguments": '{"city": "Oslo"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
    {"type": "item_reference", "id": "x"}]
TEXT_FORMATS: list[Any] = [
    {"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": {"type": "x"}},
    {"format": {"type": "json_schema", "name": "s", "schema": _CITY}}]


def _responses_fields(model: str) -> dict[str, st.SearchStrategy[Any]]:
    text = _weighted(tame_text(), st.one_of(wild_text(), huge_text()), 10)
    item = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                            "content": text}), st.sampled_from(RESPONSE_ITEMS))
    flat = [{"type": "function", **t["function"]} if t["type"] == "function" else t
            for t in FUZZ_TOOLS]
    choices = [{"type": "function", "name": "get_weather"}, "required", "auto", "none", {}]
    return {
        "model": _weighted(st.just(model), st.text(max_size=12), 10),
        "input": st.one_of(text, st.lists(item, max_size=3)), "instructions": text,
        "max_output_tokens": st.one_of(st.integers(0, 8), st.sampled_from([-1, 10**12])),
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "stream": st.booleans(),
        "tools": st.lists(st.sampled_from(flat), max_size=2),
        "tool_choice": st.sampled_from(choices), "text": st.sampled_from(TEXT_FORMATS),
        "store": st.booleans(), "previous_response_id": st.text(max_size=8),
        "parallel_tool_calls": st.booleans(), "metadata": st.just({"k": "v"})}


@st.composite
def responses_body(draw: st.DrawFn, model: str) -> Any:
    """A JSON body for /v1/responses."""
    shape = draw(st.sampled_from(["tame"] * 6 + ["any-values", "not-an-object"]))
    if shape == "not-an-object":
        return draw(_json_values())
    fields = _responses_fields(model)
    body = {k: draw(fields[k]) for k in ("model", "input")
            if draw(st.sampled_from([True] * 9 + [False]))}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[key] = draw(_json_values() if shape == "any-values" else fields[key])
    return body


@st.composite
def openai_body(draw: st.DrawFn, chat: bool, model: str) -> Any:
    """A JSON body for /v1/chat/completions (`chat`) or /v1/completions."""
    shape = draw(st.sampled_from(["tame"] * 6 + ["any-values", "not-an-object"]))
    if shape == "not-an-object":
        return draw(_json_values())
    fields = _tame_openai(chat, model)
    required = ["model", "messages" if chat else "prompt"]
    body = {k: draw(fields[k]) for k in required if draw(st.sampled_from([True] * 9 + [False]))}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[key] = draw(_json_values() if shape == "any-values" else fields[key])
    if draw(st.booleans()) and shape == "any-values":
        body[draw(st.text(max_size=12))] = draw(_json_values())
    # Keep streamed generations short: a long one proves nothing a short one does not.
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body.setdefault("stream", False)
    return body


OPENAI_ROUTES: list[tuple[str, Callable[[str], st.SearchStrategy[Any]]]] = [
    ("/v1/completions", lambda model: openai_body(False, model)),
    ("/v1/chat/completions", lambda model: openai_body(True, model)),
    ("/v1/responses", responses_body),
]
