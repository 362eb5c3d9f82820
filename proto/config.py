"""Configuration that travels to every process.

`ServerConfig` is built once from the command line (`tandem.cli`) and handed to each child as
JSON; each process reads the part it needs.  `Addresses` names every channel so that the
same code runs over `ipc://` inside one host and `tcp://` across containers.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Addresses:
    scheduler_inbox: str
    frontend_inbox: str
    worker_inbox: str
    postproc_inboxes: tuple[str, ...]
    # Token batches: a shared-memory ring (segment name + doorbell + side channel for
    # oversize messages) when every reader shares our IPC namespace, else ZeroMQ PUB/SUB.
    token_pub: str
    ring_name: str = ""  # empty: no ring, use token_pub
    ring_doorbell: str = ""
    ring_side: str = ""
    # The launcher's own inbox for supervision reports (a hung worker), apart from the
    # request traffic of the frontend inbox.
    supervisor: str = ""

    @classmethod
    def local(cls, run_dir: str, tag: str, num_postproc: int, use_ring: bool) -> Addresses:
        def ipc(name: str) -> str:
            return f"ipc://{run_dir}/{name}"

        return cls(
            scheduler_inbox=ipc("scheduler"),
            frontend_inbox=ipc("frontend"),
            worker_inbox=ipc("worker"),
            postproc_inboxes=tuple(ipc(f"postproc{i}") for i in range(num_postproc)),
            token_pub=ipc("tokens"),
            ring_name=f"tandem_{tag}_tokens" if use_ring else "",
            ring_doorbell=ipc("ring-doorbell") if use_ring else "",
            ring_side=ipc("ring-side") if use_ring else "",
            supervisor=ipc("supervisor"),
        )


@dataclass(frozen=True)
class ServerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8033
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    num_scheduler_steps: int = 8
    async_postproc: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    num_postproc_workers: int = 2
    shm_ring: bool = True  # token batches over shared memory (else ZeroMQ)
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derived from kv_cache_memory
    kv_cache_memory: float = 0.0  # GiB; 0: a default that fits max_num_seqs full sequences
    enable_prefix_caching: bool = True
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    # Output a stream may hold for a client that stopped reading before its request is
    # cancelled with RESOURCE_EXHAUSTED (rpc/stream_buffer.py); 0: no limit.
    max_stream_buffer_bytes: int = 1 << 20
    default_max_new_tokens: int = 20
    max_new_tokens: int = 1024  # the server's limit for one request
    include_stop_sequence: bool = True  # default when a request leaves it unset
    torch_threads: int = 0  # 0: one per core the worker may use
    # Async mode: build plan n+1 when the worker says plan n has about this much work left
    # (PlanEnding), not as soon as plan n is sent: arrivals during plan n make plan n+1.
    pace_plans: bool = True
    plan_lead_ms: float = 5.0
    enforce_eager: bool = False  # CUDA: no decode graphs (every step launched from Python)
    onednn: bool = True  # CPU float32: linear layers through oneDNN with pre-packed weights
    flash_attn: bool = True  # CUDA 16-bit: flash_attn where it can page the cache, else SDPA
    # On a CPU device, cores kept for the frontend, scheduler and postproc workers; the gpu
    # worker is pinned to the rest, so the "device" is never preempted by Python work.
    # -1: 1 when the host has ≥ 2 cores and no CUDA device; 0: no pinning.
    reserved_cpus: int = -1
    shutdown_timeout: float = 30.0
    step_timeout: float = 300.0  # a plan unfinished this long means a hung gpu worker
    metrics_port: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    log_level: str = "INFO"
    # Fault injection for tests (`ipc.faults`; from TANDEM_FAULT); empty in production.
    fault: str = ""
    # The launcher's private folder (sockets, config); children remove it if the launcher
    # dies without doing so.
    run_dir: str = ""
    # Roles started one by one (`tandem run-role` with peer addresses, e.g. one container
    # each): no launcher watches the processes, so they watch each other by heartbeats.
    standalone: bool = False
    # Set by the launcher from reserved_cpus: the cores each side is pinned to (empty: none).
    worker_cpus: tuple[int, ...] = ()
    service_cpus: tuple[int, ...] = ()
    addresses: Addresses = field(default_factory=lambda: Addresses("", "", "", (), ""))

    def __post_init__(self) -> None:
        problems = config_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        raw: dict[str, Any] = json.loads(text)
        addr = raw.pop("addresses")
        addr["postproc_inboxes"] = tuple(addr["postproc_inboxes"])
        for key in ("worker_cpus", "service_cpus"):
            raw[key] = tuple(raw.get(key, ()))
        return cls(**raw, addresses=Addresses(**addr))

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


# field -> (lowest allowed, highest allowed or None); flags are the fields' names in kebab case.
_LIMITS: dict[str, tuple[float, float | None]] = {
    "port": (0, 65535), "metrics_port": (0, 65535),
    "num_scheduler_steps": (1, 1024), "max_num_seqs": (1, None),
    "max_num_batched_tokens": (1, None), "max_model_len": (0, None),
    "num_postproc_workers": (1, 64), "block_size": (1, 4096), "num_kv_blocks": (0, None),
    "kv_cache_memory": (0, None), "max_queued_requests": (1, None),
    "max_queued_tokens": (1, None), "max_stream_buffer_bytes": (0, None),
    "default_max_new_tokens": (1, None),
    "max_new_tokens": (1, None), "torch_threads": (0, None), "reserved_cpus": (-1, None),
    "plan_lead_ms": (0, None), "shutdown_timeout": (0, None), "step_timeout": (0, None),
}


def config_problems(cfg: ServerConfig) -> list[str]:
    """What is wrong with `cfg`, each naming the flag and its limit (empty: nothing)."""
    out = []
    for name, (low, high) in _LIMITS.items():
        value = getattr(cfg, name)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            out.append(f"--{name.replace('_', '-')} must be {bound} (got {value})")
    if cfg.default_max_new_tokens > cfg.max_new_tokens:
        out.append(f"--default-max-new-tokens ({cfg.default_max_new_tokens}) must not exceed "
                   f"--max-new-tokens ({cfg.max_new_tokens})")
    return out


@dataclass(frozen=True)
class ModelLimits:
    """What the gpu worker learned at load time and the other processes need."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
