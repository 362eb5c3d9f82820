"""CUDA graphs for the decode forward (CUDA only; the CPU path never imports this module).

A decode step of a small batch is dominated by kernel launches: a few hundred small kernels
whose launch cost exceeds their run time.  Replaying a captured graph launches them all at
once.  What is captured is `StepExecutor.forward_decode` (slot mapping, attention metadata,
the whole model and the LM head) over static input buffers; the sampler, the finish checks
and the state advance run eagerly after each replay on the graph's logits, so every
sampling option works on the graph path too.  So do guided rows: their masks and automaton
advances (`gpu_worker.constrain.tables`) run after the replay on per-plan buffers of fixed
shape, and a plan with grammar rows waits for the host's bitmask only after the replay is launched.

Graphs are keyed by (batch bucket, gather width bucket, LoRA rows or not):

* the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16 up to max_num_seqs);
  padded rows are masked (slot -1: their KV lands in the scratch block) and ignored;
* the SDPA decode path gathers a host-known number of blocks per row, fixed at capture, so
  the width is bucketed by powers of two of blocks up to ceil(max_model_len / block_size);
  a plan uses the smallest width that covers its longest row after its K steps;
* a plan with adapter rows replays a graph that also applies every adapter slot
  (`gpu_worker.lora`; with Triton, BGMV kernels that read each row's own slot only), its
  rows' slots copied into a static buffer once per plan (padded rows: slot 0, no adapter);
  loading an adapter rewrites the slot weights in place.

Every key is captured at start-up (`capture_all`, before the worker reports ready), into
one shared memory pool: a capture mid-serving stalls every stream for a warm-up forward and
the capture itself (the first H200 run saw 140-165 ms gaps while graphs were captured
lazily).  Replays never overlap (one stream, one step at a time), so every graph writes its
logits into one static buffer rather than keeping an output of its own.  Anything the
graphs do not cover (a batch above the largest bucket, a row longer than the widest width)
runs eagerly, as does everything after a failed capture.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.batch import DecodeBatch
    from tandem_serve.gpu_worker.lora import LoraContext

log = logging.getLogger(__name__)

T = TypeVar("T")

# (input_ids, positions, active, block_tables, max_seq_len, lora) -> logits [B, V]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                      "LoraContext | None"], torch.Tensor]
# The adapter rows' slots [B] -> a context over every slot (LoraWeights.full_context).
LoraFn = Callable[[torch.Tensor], "LoraContext"]
GraphStep = Callable[["DecodeBatch"], torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


def batch_buckets(max_num_seqs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    out += list(range(16, max_num_seqs, 16))
    return out + [max_num_seqs]


def width_buckets(max_blocks: int) -> list[int]:
    out, w = [], 1
    while w < max_blocks:
        out.append(w)
        w *= 2
    return out + [max_blocks]


class DecodeGraphs:
    def __init__(self, forward: ForwardFn, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, lora: LoraFn | None = None) -> None:
        self._forward = forward
        self._lora = lora
        self._block_size = block_size
        self._batches = batch_buckets(max_num_seqs)
        self._widths = width_buckets(max_blocks_per_seq)
        n, w = self._batches[-1], self._widths[-1]
        self._ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._pos = torch.zeros(n, dtype=torch.int64, device=device)
        self._active = torch.zeros(n, dtype=torch.bool, device=device)
        self._tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self._slots = torch.zeros(n, dtype=torch.int64, device=device)  # adapter slot per row
        self._logits: torch.Tensor | None = None  # [n, V], every graph's output
        self._graphs: dict[tuple[int, int, bool], tuple[Replayable, torch.Tensor]] = {}
        self._pool: Any = None  # a graph memory pool handle, made at the first capture
        self.enabled = True

    def for_plan(self, b: DecodeBatch, num_steps: int) -> GraphStep | None:
        """A step function replaying the right graph for this plan's batch, or None (eager)."""
        if not self.enabled:
            return None
        rows = b.size
        # The longest row reads max_position + num_steps positions by the plan's last step.
        need = -(-(b.max_position + num_steps) // self._block_size)
        bucket = next((x for x in self._batches if x >= rows), None)
        width = next((x for x in self._widths if x >= need), None)
        if bucket is None or width is None or b.block_tables.shape[1] > self._tables.shape[1]:
            return None
        self._tables[:bucket].zero_()
        self._tables[:rows, : b.block_tables.shape[1]].copy_(b.block_tables)
        self._ids[rows:bucket].zero_()
        self._pos[rows:bucket].zero_()
        self._active[:bucket].zero_()  # masked while capturing; each step copies its rows in
        lora = b.lora is not None and self._lora is not None
        if lora:
            assert b.lora is not None
            self._slots[:bucket].zero_()
            self._slots[:rows].copy_(b.lora.slots)
        entry = self._graphs.get((bucket, width, lora))
        if entry is None:
            entry = self._capture(bucket, width, lora)
            if entry is None:
                return None
        graph, logits = entry

        def step(batch: DecodeBatch) -> torch.Tensor:
            self._ids[:rows].copy_(batch.input_ids)
            self._pos[:rows].copy_(batch.positions)
            self._active[:rows].copy_(batch.active)
            graph.replay()
            return logits[:rows]

        return step

    def capture_all(self, lora: bool = False) -> int:
        """Capture every (batch, width) key, and with `lora` every key with adapter rows too;
        returns how many graphs there are (fewer after a failed capture: then none runs)."""
        keys = [(b, w, a) for a in ((False, True) if lora else (False,))
                for w in self._widths for b in self._batches]
        t0, step = time.monotonic(), max(1, len(keys) // 10)
        for i, (bucket, width, adapters) in enumerate(keys, 1):
            if (bucket, width, adapters) not in self._graphs and \
                    self._capture(bucket, width, adapters) is None:
                return 0
            if i % step == 0 or i == len(keys):
                log.info("decode graphs: %d/%d captured (%.1f s)", i, len(keys),
                         time.monotonic() - t0)
        return len(self._graphs)

    @torch.inference_mode()
    def _capture(self, bucket: int, width: int,
                 lora: bool) -> tuple[Replayable, torch.Tensor] | None:
        ids, pos, active = self._ids[:bucket], self._pos[:bucket], self._active[:bucket]
        tables = self._tables[:bucket, :width]
        slots = self._slots[:bucket]
        max_seq_len = width * self._block_size

        def run() -> torch.Tensor:
            context = self._lora(slots) if lora and self._lora is not None else None
            logits = self._forward(ids, pos, active, tables, max_seq_len, context)
            if self._logits is None:  # the first (warm-up) run sizes the shared output
                self._logits = torch.empty((self._ids.shape[0], logits.shape[1]),
                                           dtype=logits.dtype, device=logits.device)
            return self._logits[:bucket].copy_(logits)

        try:
            entry = self._record(run)
        except Exception:  # noqa: BLE001 - any capture failure means: run eagerly from now on
            log.exception("CUDA graph capture failed (batch %d, %d blocks); decoding eagerly",
                          bucket, width)
            self.enabled = False
            return None
        self._graphs[(bucket, width, lora)] = entry
        log.debug("captured decode graph: batch %d, %d blocks per row%s", bucket, width,
                  ", LoRA" if lora else "")
        return entry

    def _record(self, run: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """Capture `run` into a graph; its output tensor is rewritten by every replay."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record(run, self._pool)


def record(run: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture `run` into a graph on the memory pool `pool`, with what it returned while
    captured (replays rewrite it).  Shared by the decode graphs and the mixed steps' pieces
    (`gpu_worker.graphs.piecewise`)."""
    # Warm up on a side stream first (lazy library init must not be captured).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the publisher thread may wait on copy events meanwhile.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out
