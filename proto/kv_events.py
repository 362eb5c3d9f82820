"""`--kv-events-config`: publishing the prefix cache's changes, spelled as vLLM spells it.

The flag's value is a JSON object with vLLM's `KVEventsConfig` keys, e.g.
``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}``.  `ServerConfig` keeps the text
(it travels as JSON to every process); the scheduler, which owns the prefix cache, parses it
with `parse_kv_events` (ValueError naming the key and what it must be) and publishes
(`scheduler/kv/events.py`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's defaults, key for key (`vllm/config/kv_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" records nothing
    # PUB address: bound when it has a wildcard ("*", "::") or is ipc:// / inproc://, else
    # connected (vLLM's rule: bind stable, connect volatile).
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str = ""  # ROUTER address serving replays ("": none)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    # vLLM's publisher thread's queue; accepted (and checked) for the same JSON to work,
    # but Tandem's scheduler sends each batch itself and queues nothing.
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_INTS = {"buffer_steps": (1, 1 << 24), "hwm": (0, 1 << 30), "max_queue_size": (1, 1 << 24)}
_STRS = ("publisher", "endpoint", "replay_endpoint", "topic")


def parse_kv_events(text: str) -> KvEventsConfig:
    """The config in `text` ("": events off); ValueError naming the bad key."""
    if not text.strip():
        return KvEventsConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = KvEventsConfig.__dataclass_fields__
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(known)})")
    values = dict(raw)
    if values.get("replay_endpoint") is None:
        values["replay_endpoint"] = ""
    enable = values.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise ValueError(f"--kv-events-config: enable_kv_cache_events must be true or false "
                         f"(got {enable!r})")
    for key in _STRS:
        if key in values and not isinstance(values[key], str):
            raise ValueError(f"--kv-events-config: {key} must be a string (got "
                             f"{values[key]!r})")
    for key, (low, high) in _INTS.items():
        value = values.get(key, getattr(KvEventsConfig, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"--kv-events-config: {key} must be an integer between {low} "
                             f"and {high} (got {value!r})")
    if enable and "publisher" not in values:
        values["publisher"] = "zmq"  # vLLM: enabling events without a publisher means zmq
    cfg = KvEventsConfig(**values)
    if cfg.publisher not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: publisher {cfg.publisher!r} is not one of "
                         f"{', '.join(PUBLISHERS)}")
    for key in ("endpoint", "replay_endpoint"):
        address = getattr(cfg, key)
        if address and not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: {key} {address!r} must be a ZeroMQ "
                             f"address (tcp://HOST:PORT, ipc://PATH)")
    if cfg.publishing and not cfg.endpoint:
        raise ValueError("--kv-events-config: endpoint is required with publisher 'zmq'")
    return cfg
