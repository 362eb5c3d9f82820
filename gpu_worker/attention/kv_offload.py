"""The host KV tier's memory: `--kv-offloading-size` GiB of host slots beside the device
cache, one block (every layer's K and V, and a draft model's, which mirrors our block ids)
per slot, and the copies each plan names (`StepPlan.offload_*`, `onload_*`; the scheduler
decides them, `scheduler/kv/host_tier.py`).

A slot is one contiguous row of bytes, so one block moves in one copy whatever the cache's
element type (fp8 included).  On CUDA the pool is pinned, device -> host copies run on a
side stream (a gather on the plan's stream into a temporary, then the slot copies, which
the plan's forwards do not wait for), and host -> device copies on the plan's stream after
the side stream's earlier work (a slot read back may have been written by an offload just
queued).  Neither reads anything back to the host: the K-step loop never waits for a copy.
On a CPU device the copies are plain memory copies before the plan's forwards.

The tier lives in the gpu worker's process, on the worker's host, on every tensor-parallel
rank (each holds its shard of every block: `--kv-offloading-size` is the sum over ranks, as
vLLM's is); the scheduler only indexes it, so it may run on another host.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tandem_serve.ipc.process import StartupError, available_host_bytes
from tandem_serve.proto.plan_messages import StepPlan

log = logging.getLogger(__name__)


class HostKvPool:
    """Host slots for the blocks of `caches` (every [num_blocks + 1, block_size, H, D] KV
    tensor of this rank), and the plan's copies between them."""

    def __init__(self, caches: Sequence[torch.Tensor], gib: float, device: torch.device
                 ) -> None:
        self.device = device
        self.views = [c.view(c.shape[0], -1).view(torch.uint8) for c in caches]
        self.offsets: list[tuple[int, int]] = []
        start = 0
        for view in self.views:
            self.offsets.append((start, start + view.shape[1]))
            start += view.shape[1]
        self.block_bytes = start
        wanted = int(gib * (1 << 30))
        self.num_slots = wanted // self.block_bytes
        if self.num_slots < 1:
            raise StartupError(f"--kv-offloading-size {gib:g} GiB (per rank) holds no block "
                               f"of {self.block_bytes} bytes: raise it or leave it at 0")
        free = available_host_bytes()
        if self.num_slots * self.block_bytes > free:
            raise StartupError(
                f"--kv-offloading-size asks for {wanted / 2**30:.2f} GiB of host memory "
                f"(per rank); this host has {free / 2**30:.2f} GiB available: lower it")
        cuda = device.type == "cuda"
        self.pool = torch.empty((self.num_slots, self.block_bytes), dtype=torch.uint8,
                                pin_memory=cuda)
        self.stream = torch.cuda.Stream(device) if cuda else None
        log.info("host KV tier: %d blocks, %.1f MiB%s", self.num_slots,
                 self.pool.nbytes / 2**20, " pinned" if cuda else "")

    def run(self, plan: StepPlan) -> None:
        """The plan's copies, before any of its forwards: offloads first (an evicted block
        may be this plan's onload target), then onloads."""
        if plan.offload_blocks:
            self.offload(plan.offload_blocks, plan.offload_slots)
        if plan.onload_slots:
            self.onload(plan.onload_slots, plan.onload_blocks)

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64).to(self.device, non_blocking=True)

    def offload(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        idx = self._index(blocks)
        rows = torch.cat([view.index_select(0, idx) for view in self.views], dim=1)
        if self.stream is None:
            self.pool.index_copy_(0, torch.tensor(list(slots), dtype=torch.int64), rows)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, slot in enumerate(slots):
                self.pool[slot].copy_(rows[i], non_blocking=True)
        rows.record_stream(self.stream)  # freed only once the side stream has read it

    def onload(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        if self.stream is None:
            rows = self.pool.index_select(0, torch.tensor(list(slots), dtype=torch.int64))
        else:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            rows = torch.empty((len(slots), self.block_bytes), dtype=torch.uint8,
                               device=self.device)
            for i, slot in enumerate(slots):
                rows[i].copy_(self.pool[slot], non_blocking=True)
        idx = self._index(blocks)
        for view, (start, end) in zip(self.views, self.offsets, strict=True):
            view.index_copy_(0, idx, rows[:, start:end])
