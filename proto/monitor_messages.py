"""Messages that watch the engine rather than drive it: the scheduler's counters, the
postproc workers' lag, heartbeats of roles on their own, and profiling's control and data.

Registered with the codec through `proto.messages.MESSAGE_TYPES`, like every message.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# ---------------------------------------------------------------- scheduler -> frontend (admin)


@dataclass
class EngineStats:
    """The scheduler's counters for the frontend's read-only admin service.

    Sent when they changed, at most every 0.2 s; the frontend keeps the latest.
    """

    num_free_blocks: int  # free plus evictable cached blocks
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tokens_delivered: int
    tokens_after_finish: int
    # Time accounting since start, for the device-idle share and per-plan costs.
    uptime_s: float = 0.0
    num_plans: int = 0
    worker_busy_s: float = 0.0  # sum of the gpu worker's plan wall times
    forward_s: float = 0.0  # sum of the plans' forward (prefill + decode) times
    postproc_busy_s: float = 0.0  # per postproc worker, averaged over the workers
    # Decode-only plans: time inside them, and time the worker waited before them.
    steady_busy_s: float = 0.0
    steady_idle_s: float = 0.0
    # Arrival to first scheduling of each request first scheduled since the previous report,
    # for the frontend's queue-time histogram (not part of the admin Stats answer).
    queue_times_s: list[float] = field(default_factory=list)
    # LoRA: adapters resident in the gpu worker's slots (slot order) and loads since start.
    loaded_adapters: list[str] = field(default_factory=list)
    adapter_loads: int = 0
    # LoRA: the adapters of running and of waiting requests, each in order of first appearance
    # (vLLM's lora_requests_info labels, which endpoint pickers read for adapter affinity).
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    # Speculative decoding since start (StepDone's counts): row-steps with a draft, draft
    # tokens, accepted draft tokens.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_per_pos: list[int] = field(default_factory=list)  # by draft position
    # The host KV tier (--kv-offloading-size), in tokens since start like the prefix cache's
    # counters (vLLM's external_prefix_cache_*), and its blocks in use and in all.
    external_query_tokens: int = 0
    external_hit_tokens: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    # The request ids of queue_times_s, in its order (request traces' time in queue).
    queue_time_ids: list[int] = field(default_factory=list)


@dataclass
class Heartbeat:
    """Roles started on their own (one container each) prove they are alive with these.

    They also say who is who (`ipc.peers`): `incarnation` is random per process, so a role
    restarted under the same name is a new one; `epoch` is the set the sender serves in (0:
    none yet).  The frontend's own lists the incarnations it admitted to its set.
    """

    role: str
    index: int = 0
    incarnation: int = 0
    epoch: int = 0
    members: list[int] = field(default_factory=list)


@dataclass
class ProfileControl:
    """Frontend → every process: start recording spans, or stop and send them back."""

    start: bool
    # gpu worker only: stop by itself after this many plans and send its data unasked (0: when
    # told), and run torch.profiler over the same window into this file (absolute; "" = off).
    plans: int = 0
    torch_trace: str = ""


@dataclass
class ProfileData:
    """A process's recorded spans: rows of (name, start_ns, end_ns, plan, step)."""

    role: str
    started_ns: int
    stopped_ns: int
    spans: list
    counters: list
    plans: int = 0  # plans finished inside the window (gpu worker)
    torch_trace: str = ""  # the torch.profiler trace the gpu worker wrote
    torch_error: str = ""  # why it could not (the recording itself is still good)


@dataclass
class PostprocStats:
    """Postproc → frontend, at most every 0.2 s and only on change: how far it lagged.

    `lag_steps`: the most token batches (one per step) that the gpu worker had published and
    this worker had not processed yet, over the interval since its previous report.
    """

    index: int
    lag_steps: int
