"""Tensor parallelism: the process group, the collectives a sharded model runs, and rank 0's
side of the plan fan-out.

Every rank is one gpu worker process holding its shard of the weights
(`gpu_worker.models.sharding`) and of the KV cache (its kv heads).  The ranks join one
`torch.distributed` process group over a TCP rendezvous (`--dist-init-addr`): NCCL on CUDA,
gloo on CPU.  Per layer the model runs two all-reduces (after the row-parallel o_proj and
down_proj), one for the vocab-parallel embedding, and one all-gather of the vocab-sharded
logits; every rank then holds the same full logits and samples them with the same
counter-based sampler (its draws depend on (seed, output_count) only, no generator state),
so the ranks agree on every token without exchanging any.  Nothing here reads a device
value: on CUDA the collectives are ordered on the stream like any kernel, so the K-step
loop stays free of host syncs (and CUDA graphs capture them).

Rank 0 alone talks to the scheduler and the postproc workers; it forwards each `StepPlan`
(and profile controls and shutdown) to the other ranks before it runs it (`Leader`), over a
ZeroMQ XPUB socket with the msgpack codec (`ipc.fanout`): see DESIGN.md for why not a
torch.distributed broadcast.  The other ranks run the same plans (`gpu_worker.follower`).
"""
from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem_serve.gpu_worker.models.decoder import CausalLM, DecoderLayer
from tandem_serve.gpu_worker.models.sharding import Shard, vocab_range
from tandem_serve.ipc.fanout import Fanout
from tandem_serve.ipc.peers import HEARTBEAT_INTERVAL, START_GRACE
from tandem_serve.ipc.process import PeerDied, StartupError
from tandem_serve.proto.config import ServerConfig, dist_host_port, plans_address
from tandem_serve.proto.control_messages import Shutdown
from tandem_serve.proto.monitor_messages import Heartbeat

log = logging.getLogger("tandem.gpu_worker")

# A collective waits this long past --step-timeout for a silent peer: the scheduler's hang
# watchdog speaks first (it names the hung plan); then the collective fails.
_TIMEOUT_MARGIN_S = 30.0
_NO_STEP_TIMEOUT_S = 1800.0


# What gloo says when the peer's socket closed or went silent (NCCL raises DistError).
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout")


class RankLost(RuntimeError):
    """A rank on another host died or went silent.  No launcher here watches that process,
    so this error is the cause to report (not a consequence, as `PeerDied` is)."""


@dataclass
class TensorParallel:
    """This process's rank in the group and the collectives the sharded model calls."""

    shard: Shard
    local_rank: int
    device: torch.device
    multi_node: bool = False  # some ranks run on other hosts (not the launcher's children)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (the row-parallel partial outputs)."""
        try:
            dist.all_reduce(t)
        except RuntimeError as exc:
            raise self._classify("all-reduce", exc) from exc
        return t

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor:
        """[T, V/N] logits of this rank's vocabulary rows -> [T, V], the same on every rank."""
        rows = t.shape[0]
        out = torch.empty((self.size * rows, t.shape[1]), dtype=t.dtype, device=t.device)
        try:
            dist.all_gather_single(out, t.contiguous())  # rank-major: [N * T, V/N]
        except RuntimeError as exc:
            raise self._classify("all-gather", exc) from exc
        return out.view(self.size, rows, -1).permute(1, 0, 2).reshape(rows, -1)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (start-up only: it reads the result)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def max_float(self, value: float) -> float:
        """The largest `value` over the ranks (between plans: it reads the result), so
        host decisions made from per-rank timings agree."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def install(self, model: CausalLM) -> None:
        """Join a model loaded with `shard=self.shard` to the other ranks' shards."""
        for layer in model.layers:
            cast(DecoderLayer, layer).reduce = self.all_reduce
        lo, hi = vocab_range(model.config, self.shard)
        model.embed = partial(self._embed, model, lo, hi)
        model.gather_logits = self.gather_vocab

    def _embed(self, model: CausalLM, lo: int, hi: int, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of its ids, zeros elsewhere, and
        the sum over ranks is the whole lookup (exact: every row has one nonzero term)."""
        local = ids - lo
        outside = (local < 0) | (local >= hi - lo)
        x = F.embedding(local.clamp(0, hi - lo - 1), model.embed_tokens)
        return self.all_reduce(x.masked_fill(outside.unsqueeze(1), 0.0))

    def _classify(self, op: str, exc: RuntimeError) -> RuntimeError:
        """A collective's error: a peer rank died or stopped answering (PeerDied on one
        host, where the launcher sees the peer's own exit; RankLost across hosts), else
        the error itself (a bug of ours)."""
        if not (isinstance(exc, dist.DistError)
                or any(w in str(exc).lower() for w in _PEER_GONE)):
            return exc
        kind = RankLost if self.multi_node else PeerDied
        return kind(f"tensor-parallel {op} failed (a peer rank died or stopped answering): "
                    f"{exc}")

    def close(self) -> None:
        """Leave the group (on any exit: gloo's threads abort the process at exit otherwise;
        with NCCL and a dead peer this may block, and the launcher's SIGKILL ends it)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def collective_timeout(cfg: ServerConfig) -> datetime.timedelta:
    seconds = cfg.step_timeout + _TIMEOUT_MARGIN_S if cfg.step_timeout else _NO_STEP_TIMEOUT_S
    return datetime.timedelta(seconds=max(seconds, START_GRACE if cfg.nnodes > 1 else 0))


def start(cfg: ServerConfig, rank: int) -> TensorParallel:
    """Join the process group as `rank` (blocks until every rank has joined)."""
    size = cfg.tensor_parallel_size
    local = rank - cfg.node_rank * cfg.ranks_per_node
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda:
        found = torch.cuda.device_count()
        if found < cfg.ranks_per_node:
            raise StartupError(f"--tensor-parallel-size {size}: {cfg.ranks_per_node} ranks "
                               f"on this node need as many CUDA devices, found {found}")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    host, port = dist_host_port(cfg)
    backend = "nccl" if cuda else "gloo"
    t0 = time.monotonic()
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=size, timeout=collective_timeout(cfg),
                            device_id=device if cuda else None)
    log.info("rank %d of %d joined the %s group at %s:%d in %.2f s", rank, size, backend,
             host, port, time.monotonic() - t0)
    return TensorParallel(Shard(rank, size), local, device, multi_node=cfg.nnodes > 1)


class Leader:
    """Rank 0's side of the plan channel: every message it forwards reaches every other rank
    before rank 0 runs it; when idle it sends heartbeats (ranks on other hosts exit when they
    stop) and notices a rank whose connection closed."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.fanout = Fanout(plans_address(cfg), cfg.tensor_parallel_size - 1)
        self._remote = cfg.nnodes > 1
        self._beat = Heartbeat(cfg.worker_role(0), 0)
        self._sent = time.monotonic()

    def wait_followers(self, timeout: float = START_GRACE) -> None:
        self.fanout.wait_subscribers(timeout)

    def forward(self, msg: object) -> None:
        self.fanout.put(msg)
        self._sent = time.monotonic()

    def idle(self) -> None:
        """Between plans: a heartbeat when nothing went out for a while; PeerDied when a
        rank's plan connection closed (it died) while no collective would have told us."""
        if time.monotonic() - self._sent >= HEARTBEAT_INTERVAL:
            self.forward(self._beat)
        if self.fanout.lost():
            if self._remote:
                raise RankLost("a gpu worker rank on another host disconnected from the plan "
                               "channel (it died, or its host is unreachable)")
            raise PeerDied("a tensor-parallel rank disconnected from the plan channel "
                           "(it died)")

    def close(self) -> None:
        self.fanout.close()


@contextmanager
def lead(cfg: ServerConfig) -> Iterator[tuple[Leader, TensorParallel]]:
    """Rank 0's plan channel and its place in the group, for as long as rank 0 runs.  A
    SIGTERM'd rank 0 tells the other ranks to stop (those on other hosts then exit 0), and
    the channel closes before the group, so that last message still goes out."""
    ranks = Leader(cfg)  # bound first: the others subscribe as they start
    tp: TensorParallel | None = None
    try:
        tp = start(cfg, 0)
        yield ranks, tp
    except SystemExit:
        ranks.forward(Shutdown("gpu worker rank 0 stopped"))
        raise
    finally:
        ranks.close()
        if tp is not None:
            tp.close()
