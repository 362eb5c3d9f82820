"""The soak's request mix: every output path of the server, in proportions you choose.

Kinds (`--mix kind=weight,...`):
- plain: greedy text;
- detail: generated tokens with logprobs, ranks and 3 alternatives each;
- stop: stop sequences (the postproc matcher and early finishes);
- sample: seeded sampling with temperature and top-p;
- cancel: a stream the client cancels after a few messages (aborts through every process);
- guided: a guided-decoding constraint (choice, regex, JSON schema or any JSON object) in
  `params.decoding`; `--guided-share` sets its share of all requests.  A server without
  guided decoding answers UNIMPLEMENTED, which the soak counts as failures: give it a share
  only where the server supports it.
"""
from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

WORDS = ("time river model token stream engine quick brown fox jumps over lazy dog light "
         "paper window garden number seven north market silver cloud winter music").split()
KINDS = ("plain", "detail", "stop", "sample", "cancel", "guided")
DEFAULT_MIX = "plain=3,detail=2,stop=2,sample=2,cancel=1"

GUIDED = [  # (oneof field of params.decoding, value)
    ("choice", ["yes", "no", "maybe"]),
    ("regex", r"[0-9]{3}-[a-z]{2,4}"),
    ("json_schema", json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"]})),
    ("format", 1),  # ResponseFormat.JSON: any JSON object
]


@dataclass
class RequestStats:
    sent: int = 0
    ok: int = 0
    cancelled: int = 0  # by the client, mid-stream (the cancel kind)
    failed: dict[str, int] = field(default_factory=dict)
    by_kind: Counter[str] = field(default_factory=Counter)  # finished as meant, per kind
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    start_delays: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def parse_mix(text: str, guided_share: float) -> dict[str, float]:
    """Kind -> probability; `guided_share` of all requests are guided, the rest as weighted."""
    weights: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        kind, _, w = part.partition("=")
        if kind not in KINDS or kind == "guided":
            raise ValueError(f"--mix: unknown kind {kind!r}; choose from "
                             f"{', '.join(k for k in KINDS if k != 'guided')}")
        weights[kind] = float(w or 1)
    if not 0 <= guided_share <= 1:
        raise ValueError(f"--guided-share must be in [0, 1], got {guided_share:g}")
    total = sum(weights.values())
    if total <= 0 and guided_share < 1:
        raise ValueError("--mix: give at least one kind a positive weight")
    mix = {k: (1 - guided_share) * w / total for k, w in weights.items()} if total else {}
    if guided_share:
        mix["guided"] = guided_share
    return mix


def choose(rng: random.Random, mix: dict[str, float]) -> str:
    return rng.choices(list(mix), weights=list(mix.values()))[0]


def make_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def build(kind: str, rng: random.Random, seed: int, max_new_tokens: int) -> Any:
    """The SingleGenerationRequest for one request of `kind`."""
    from tandem_serve.proto import generation_pb2 as pb
    from tandem_serve.rpc.client import GenerateOptions

    opts = GenerateOptions(max_new_tokens=rng.randint(max(1, max_new_tokens // 4),
                                                      max_new_tokens))
    if kind == "detail":  # logprobs, ranks, top-n text per token
        opts.generated_tokens, opts.token_logprobs, opts.token_ranks = True, True, True
        opts.top_n_tokens = 3
    elif kind == "stop":  # the postproc side's matcher and early finishes
        opts.stop_sequences = [rng.choice(WORDS), "\n\n"]
    elif kind == "sample":
        opts.sample, opts.temperature, opts.top_p, opts.seed = True, 0.8, 0.9, seed
    elif kind == "cancel":  # long enough to be cut
        opts.max_new_tokens = opts.min_new_tokens = max_new_tokens
    req = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=make_prompt(rng)),
                                     params=opts.to_proto())
    if kind == "guided":
        name, value = rng.choice(GUIDED)
        decoding = req.params.decoding
        if name == "choice":
            decoding.choice.choices.extend(value)
        else:
            setattr(decoding, name, value)
    return req


def run_one(client: Any, seed: int, mix: dict[str, float], max_new_tokens: int,
            stats: RequestStats, scheduled: float) -> None:
    """One request of a kind drawn from `mix`, its outcome into `stats`."""
    import grpc

    rng = random.Random(seed)
    kind = choose(rng, mix)
    req = build(kind, rng, seed, max_new_tokens)
    cut_after = rng.randint(2, 6) if kind == "cancel" else 0
    start = time.monotonic()
    tokens = messages = 0
    call = client.stub.GenerateStream(req, timeout=300)
    try:
        for resp in call:
            tokens = resp.generated_token_count or tokens
            messages += 1
            if messages == cut_after:
                call.cancel()
    except grpc.RpcError as exc:
        code = exc.code().name if exc.code() is not None else "UNKNOWN"
        with stats.lock:
            if code == "CANCELLED" and cut_after:
                stats.cancelled += 1
                stats.by_kind[kind] += 1
            else:
                stats.failed[code] = stats.failed.get(code, 0) + 1
        return
    with stats.lock:
        stats.ok += 1
        stats.by_kind[kind] += 1
        stats.tokens += tokens
        stats.latencies.append(time.monotonic() - start)
        stats.start_delays.append(start - scheduled)
