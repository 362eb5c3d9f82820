"""vLLM's KV-cache events, published by the scheduler (`--kv-events-config`).

KV-aware routers (llm-d's KV-cache indexer, NVIDIA Dynamo) keep an index of which replica
holds which prefix by subscribing to every replica's events.  The wire format is vLLM's
`vllm/distributed/kv_events.py` in its msgspec *array-like* encoding (vLLM's releases
before events became maps keyed by field name):

* a ZeroMQ PUB multipart message ``(topic, seq, payload)``: the topic as UTF-8, the batch's
  sequence number (0, 1, 2, ... with no gaps) as 8 bytes big-endian, and the payload;
* the payload is msgpack of ``KVEventBatch`` = ``[ts, [event, ...], data_parallel_rank]``
  (ts: time.time(); rank 0: one engine per Tandem server);
* each event is a tagged array, its class name first, every field written (msgspec's
  omit_defaults does not shorten array-like structs), as in vLLM's last array-like schema:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx]``, ``["BlockRemoved", block_hashes, medium,
  group_idx]``, ``["AllBlocksCleared"]`` (extra_keys and group_idx are nil: no
  multimodal keys, one KV cache group).  Subscribers built on an older array-like schema
  (v0.10.2-v0.11: BlockStored ends at `medium`, BlockRemoved at `medium`) read it too:
  msgspec ignores trailing extras of an array-like struct.
* block hashes are vLLM's default external form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1):
  the last 8 bytes of the block's digest as an unsigned big-endian integer.  The same
  block has the same hash on both media, "GPU" (the device cache, whatever the device)
  and "CPU" (the host tier).
* a ROUTER socket at `replay_endpoint` answers a request frame holding a start sequence
  number (8 bytes big-endian) with every buffered batch from there on, each as
  ``(seq, payload)``, then ``(-1, b"")``.

Encoded with msgpack (a dependency of every process already); tests decode with msgspec
Structs shaped as vLLM's, so the two encoders are held to the same bytes' meaning.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgpack
import zmq

from tandem_serve.proto.kv_events import KvEventsConfig
from tandem_serve.scheduler.kv.host_tier import (
    Cleared,
    KvEvent,
    KvTier,
    Removed,
    Stored,
    lora_int_id,
)
from tandem_serve.scheduler.requests import Request

log = logging.getLogger("tandem.scheduler")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DATA_PARALLEL_RANK = 0


def record_stored(tier: KvTier, req: Request, stored: Sequence[int]) -> None:
    """Tell `tier` which prompt blocks of `req` (indices, ascending) were just registered in
    the device cache: one stored event per run of consecutive blocks."""
    size = tier.block_size
    start = 0
    while start < len(stored):
        end = start
        while end + 1 < len(stored) and stored[end + 1] == stored[end] + 1:
            end += 1
        first, last = stored[start], stored[end] + 1
        parent = req.prompt_block_hashes[first - 1] if first else None
        tier.device_stored(req.blocks[first:last], req.prompt_block_hashes[first:last],
                           parent, req.prompt_ids[first * size : last * size], req.adapter_id)
        start = end + 1


def wire_hash(digest: bytes) -> int:
    """vLLM's integer form of a block hash (`maybe_convert_block_hash`)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def wire_event(event: KvEvent, block_size: int) -> list[object]:
    if isinstance(event, Stored):
        parent = None if event.parent is None else wire_hash(event.parent)
        return ["BlockStored", [wire_hash(h) for h in event.hashes], parent, event.token_ids,
                block_size, lora_int_id(event.adapter_id), event.medium,
                event.adapter_id or None, None, None]  # extra_keys, group_idx
    if isinstance(event, Removed):
        return ["BlockRemoved", [wire_hash(h) for h in event.hashes], event.medium, None]
    assert isinstance(event, Cleared)
    return ["AllBlocksCleared"]


def encode_batch(events: Sequence[KvEvent], block_size: int, ts: float) -> bytes:
    """A KVEventBatch's payload."""
    return msgpack.packb([ts, [wire_event(e, block_size) for e in events],
                          DATA_PARALLEL_RANK], use_bin_type=True)


def _binds(endpoint: str) -> bool:
    # vLLM's rule: bind a stable address (a wildcard, ipc, inproc), connect to a volatile one.
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class KvEventPublisher:
    """The PUB socket, the replay buffer and the thread that serves replays."""

    def __init__(self, cfg: KvEventsConfig, block_size: int) -> None:
        self.block_size = block_size
        self.topic = cfg.topic.encode()
        self.ctx: zmq.Context = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(cfg.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        if _binds(cfg.endpoint):
            self.pub.bind(cfg.endpoint)
        else:
            self.pub.connect(cfg.endpoint)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.replay_thread: threading.Thread | None = None
        if cfg.replay_endpoint:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(cfg.replay_endpoint)
            self.replay_thread = threading.Thread(target=self._serve_replays, args=(router,),
                                                  name="kv-events-replay", daemon=True)
            self.replay_thread.start()
        log.info("KV events: publishing on %s (replay: %s, topic %r)", cfg.endpoint,
                 cfg.replay_endpoint or "none", cfg.topic)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """One batch (nothing when `events` is empty, as vLLM)."""
        if not events:
            return
        payload = encode_batch(events, self.block_size, time.time())
        seq = self.seq
        self.seq += 1
        try:  # PUB drops at the high-water mark; it never blocks the scheduler
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload),
                                    flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        with self.lock:
            self.buffer.append((seq, payload))

    def _serve_replays(self, router: zmq.Socket) -> None:
        try:
            while not self.stopping.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    log.warning("KV events: a replay request of %d frames (want 3)",
                                len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self.lock:
                    batches = [(s, p) for s, p in self.buffer if s >= first]
                for seq, payload in batches:
                    router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                router.send_multipart((client, b"", END_SEQ, b""))
        finally:
            router.close(0)

    def close(self) -> None:
        self.stopping.set()
        if self.replay_thread is not None:
            self.replay_thread.join(2.0)
        self.pub.close(0)
