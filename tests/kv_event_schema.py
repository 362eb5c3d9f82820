"""vLLM's KV-event schema as msgspec Structs, the way `vllm/distributed/kv_events.py`
declares it in its array-like releases: what a router (llm-d's indexer, Dynamo) decodes
Tandem's events with.  `BlockStored` is the shape with `lora_name`; `BlockStoredV11` the
older six-field one, which ends at `medium`."""
from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVCacheEventV11(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                      tag=True):
    pass


class BlockStoredV11(KVCacheEventV11, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemovedV11(KVCacheEventV11, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksClearedV11(KVCacheEventV11, tag="AllBlocksCleared"):
    pass


class KVEventBatchV11(EventBatch):
    events: list[BlockStoredV11 | BlockRemovedV11 | AllBlocksClearedV11]


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def decode_v11(payload: bytes) -> KVEventBatchV11:
    return msgspec.msgpack.decode(payload, type=KVEventBatchV11)
