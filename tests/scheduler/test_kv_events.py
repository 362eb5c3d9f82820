"""vLLM's KV events on the wire (`scheduler/kv/events.py`): msgspec Structs shaped as
vLLM's decode them, the PUB stream numbers batches without gaps, replays serve the buffer,
and `--kv-events-config` names the key it rejects."""
from __future__ import annotations

import os

import msgspec
import pytest
import zmq

from tandem_serve.proto.kv_events import KvEventsConfig, parse_kv_events
from tandem_serve.scheduler.kv.events import KvEventPublisher, encode_batch, wire_hash
from tandem_serve.scheduler.kv.host_tier import CPU, GPU, Cleared, Removed, Stored, lora_int_id
from tests import kv_event_schema as vllm

H1, H2 = bytes(range(16)), bytes(range(16, 32))
EVENTS = [Stored([H1, H2], None, list(range(8)), "", GPU),
          Stored([H2], H1, [4, 5, 6, 7], "my-lora", CPU), Removed([H1], GPU), Cleared()]


def test_the_payload_is_what_vllm_encodes() -> None:
    payload = encode_batch(EVENTS, 4, 1234.5)
    batch = vllm.decode(payload)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    stored, on_host, removed, cleared = batch.events
    assert stored == vllm.BlockStored([wire_hash(H1), wire_hash(H2)], None, list(range(8)),
                                      4, None, "GPU", None)
    assert on_host == vllm.BlockStored([wire_hash(H2)], wire_hash(H1), [4, 5, 6, 7], 4,
                                       lora_int_id("my-lora"), "CPU", "my-lora")
    assert removed == vllm.BlockRemoved([wire_hash(H1)], "GPU")
    assert isinstance(cleared, vllm.AllBlocksCleared)
    # Byte for byte what msgspec writes for vLLM's Structs.
    assert msgspec.msgpack.encode(batch) == payload
    old = vllm.decode_v11(payload)  # a six-field BlockStored reader skips lora_name
    assert old.events[1] == vllm.BlockStoredV11([wire_hash(H2)], wire_hash(H1), [4, 5, 6, 7],
                                                4, lora_int_id("my-lora"), "CPU")
    assert wire_hash(H1) == int.from_bytes(H1[8:], "big")  # vLLM's int hashes: low 64 bits


def test_published_batches_are_numbered_and_replayed(tmp_path: os.PathLike[str]) -> None:
    cfg = parse_kv_events(
        f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{tmp_path}/pub", '
        f'"replay_endpoint": "ipc://{tmp_path}/replay", "topic": "kv", "buffer_steps": 2}}')
    publisher = KvEventPublisher(cfg, 4)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(cfg.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(cfg.replay_endpoint)
    try:
        # A PUB drops what it sends before a subscriber's connection completes: probe first.
        while not sub.poll(50):
            publisher.publish([Cleared()])
        while sub.poll(200):
            first_seen = sub.recv_multipart()
        start = int.from_bytes(first_seen[1], "big") + 1
        publisher.publish([])  # nothing to say: no batch
        for event in EVENTS[:3]:
            publisher.publish([event])
        got = [sub.recv_multipart() for _ in range(3)]
        assert [t for t, _, _ in got] == [b"kv"] * 3
        assert [int.from_bytes(s, "big") for _, s, _ in got] == [start, start + 1, start + 2]
        assert [vllm.decode(p).events[0].medium for _, _, p in got] == ["GPU", "CPU", "GPU"]
        dealer.send_multipart([b"", (start + 1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            replies.append((int.from_bytes(seq, "big", signed=True), payload))
            if replies[-1][0] == -1:
                break
        # buffer_steps 2: the last two batches, then vLLM's end marker (-1, b"").
        assert replies == [(start + 1, got[1][2]), (start + 2, got[2][2]), (-1, b"")]
    finally:
        sub.close(0)
        dealer.close(0)
        publisher.close()


@pytest.mark.parametrize(("text", "key"), [
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"endpoint": "http://x:1"}', "endpoint"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"hwm": "lots"}', "hwm"),
    ('{"topics": ""}', "'topics'"),
    ('[1]', "JSON object"),
    ('{"topic": 3}', "topic"),
])
def test_bad_values_name_their_key(text: str, key: str) -> None:
    with pytest.raises(ValueError, match=f"--kv-events-config.*{key}"):
        parse_kv_events(text)


def test_vllm_defaults() -> None:
    assert parse_kv_events("") == KvEventsConfig()
    on = parse_kv_events('{"enable_kv_cache_events": true, "replay_endpoint": null}')
    assert on.publishing and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    assert not parse_kv_events('{"enable_kv_cache_events": true, "publisher": "null"}'
                               ).publishing
