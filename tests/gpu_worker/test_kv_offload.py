"""The host KV tier's memory (`gpu_worker/attention/kv_offload.py`): blocks round-trip
through host slots bit for bit, whatever the cache's element type."""
from __future__ import annotations

import pytest
import torch

from tandem_serve.gpu_worker.attention import kv_offload
from tandem_serve.gpu_worker.attention.kv_cache import FP8, allocate_kv_cache
from tandem_serve.gpu_worker.attention.kv_offload import HostKvPool
from tandem_serve.ipc.process import StartupError
from tandem_serve.proto.plan_messages import StepPlan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_blocks_round_trip_through_the_host(dtype: torch.dtype) -> None:
    caches = allocate_kv_cache(2, 10, 4, 2, 8, dtype, "cpu")
    tensors = [t for kv in caches for t in kv]
    for t in tensors:  # random bytes below 120: no NaN pattern in any of the types
        t.view(torch.uint8).random_(0, 120)
    before = [t.clone() for t in tensors]
    per_block = sum(t[0].nbytes for t in tensors)
    pool = HostKvPool(tensors, 5 * per_block / 2**30, torch.device("cpu"))
    assert pool.num_slots == 5 and pool.block_bytes == per_block
    # Blocks 1 and 3 leave for slots 4 and 0; block 1 is then reused for slot 0's content,
    # and block 7 takes slot 4's: offloads run before onloads.
    pool.run(StepPlan(0, 1, offload_blocks=[1, 3], offload_slots=[4, 0],
                      onload_slots=[0, 4], onload_blocks=[1, 7]))
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(t[1].view(torch.uint8), old[3].view(torch.uint8))
        assert torch.equal(t[7].view(torch.uint8), old[1].view(torch.uint8))
        for b in (0, 2, 3, 4, 5, 6, 8, 9, 10):  # scratch block 10 included: untouched
            assert torch.equal(t[b].view(torch.uint8), old[b].view(torch.uint8))


def test_a_pool_larger_than_free_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = allocate_kv_cache(1, 4, 4, 1, 8, torch.float32, "cpu")
    tensors = [t for kv in caches for t in kv]
    monkeypatch.setattr(kv_offload, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(StartupError, match="--kv-offloading-size asks for 1.00 GiB"):
        HostKvPool(tensors, 1.0, torch.device("cpu"))
    with pytest.raises(StartupError, match="holds no block"):
        HostKvPool(tensors, 1e-9, torch.device("cpu"))
