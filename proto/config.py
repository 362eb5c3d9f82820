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

from tandem_serve.proto.kv_events import parse_kv_events
from tandem_serve.proto.speculative import (
    SpeculativeConfig,
    parse_speculative,
    speculative_problems,
)
from tandem_serve.proto.vision import image_limit


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
    # Tensor parallelism: where gpu worker rank 0 publishes each plan to the other ranks
    # (empty: derived from ServerConfig.dist_init_addr, or no other ranks).
    worker_plans: str = ""

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
            worker_plans=ipc("worker-plans"),
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
    # Tokens per step: decoding rows, then prefill chunk pieces (0: the device's default,
    # `scheduler.budget.default_tokens`).  With prefill_phase (the baseline: every chunk in a
    # forward of its own before the plan's steps) per plan instead, as before mixed steps.
    max_num_batched_tokens: int = 0
    prefill_phase: bool = False
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    num_postproc_workers: int = 2
    shm_ring: bool = True  # token batches over shared memory (else ZeroMQ)
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derived from kv_cache_memory
    kv_cache_memory: float = 0.0  # GiB; 0: a default that fits max_num_seqs full sequences
    # The paged cache's element type: "auto" (the model dtype) or fp8 (e4m3; twice the blocks
    # of bf16 in the same memory; `gpu_worker.attention.kv_cache`).  vLLM's spellings.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # The host-memory KV tier (vLLM's --kv-offloading-size): GiB of host memory, summed over
    # the tensor-parallel ranks, that blocks evicted from the device cache move to and come
    # back from instead of being recomputed (`gpu_worker/attention/kv_offload.py`,
    # `scheduler/kv/host_tier.py`); 0: off.
    kv_offloading_size: float = 0.0
    # Published prefix-cache changes (`proto.kv_events`): vLLM's KVEventsConfig as JSON.
    kv_events_config: str = ""
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    # The waiting queue's order (`scheduler.priority`): "fcfs", or "priority" (a request's
    # `priority`, lower first, ties by arrival; lower-priority running requests are preempted).
    scheduling_policy: str = "fcfs"
    # Output a stream may hold for a client that stopped reading before its request is
    # cancelled with RESOURCE_EXHAUSTED (frontend/stream_buffer.py); 0: no limit.
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
    # How the gpu worker attends (`gpu_worker.attention.registry`): one of ATTENTION_BACKENDS;
    # "auto" picks flash_attn where it serves, else FlexAttention on CUDA, else SDPA.
    attention_backend: str = "auto"
    flash_attn: bool = True  # False: "auto" never picks flash_attn (--no-flash-attn)
    # "auto": the checkpoint's safetensors; "dummy": random weights made on the device, for
    # benchmarks of a model's shape without its checkpoint (the folder needs config.json and
    # the tokenizer only).
    load_format: str = "auto"
    # On a CPU device, cores kept for the frontend, scheduler and postproc workers; the gpu
    # worker is pinned to the rest, so the "device" is never preempted by Python work.
    # -1: 1 when the host has ≥ 2 cores and no CUDA device; 0: no pinning.
    reserved_cpus: int = -1
    # Tensor parallelism: the model split over this many gpu worker ranks (one process
    # each), joined by torch.distributed over a TCP rendezvous at dist_init_addr
    # (HOST:PORT; empty on one host: the launcher picks a free local port).  Across hosts,
    # nnodes hosts run tensor_parallel_size / nnodes ranks each; node 0 runs rank 0.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""
    shutdown_timeout: float = 30.0
    step_timeout: float = 300.0  # a plan unfinished this long means a hung gpu worker
    metrics_port: int = 0
    # The OpenAI-compatible HTTP API (`openai_api/`) beside gRPC, on the same host; 0: off.
    http_port: int = 8000
    # Rollout controls over HTTP (/sleep, /wake_up, /pause, /load_weights, ...; 404 without):
    # they stop or change the engine for every client, so a server offers them only when asked.
    enable_control_endpoints: bool = False
    # The `model` name HTTP clients use (empty: the model folder's name).
    served_model_name: str = ""
    # OpenAI tools and reasoning (openai_api/): tool_choice "auto" parses calls out of the
    # text with tool_call_parser; reasoning_parser splits <think> text off the content;
    # chat_template (a file, or the template's text) replaces the checkpoint's.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    chat_template: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # A key every API request must carry (`Authorization: Bearer KEY`; gRPC metadata the
    # same); "": open.  Only the frontend reads it: the launcher writes it out of the config
    # its children read.
    api_key: str = field(default="", repr=False)  # never in a log line or a traceback
    # OTLP/HTTP collector for one OpenTelemetry span per request ("": no tracing).
    otlp_traces_endpoint: str = ""
    # GET /live answers 503 once requests are open and no plan has completed for this long.
    liveness_timeout: float = 60.0
    log_level: str = "INFO"
    # Guided decoding: compiled constraints on disk ("" = memory only), the longest one
    # compile may take, and whether format=JSON (slow: seconds) compiles at start-up.
    guided_cache_dir: str = ""
    guided_compile_timeout: float = 30.0
    guided_precompile_json: bool = True
    # LoRA: adapter ids name folders under adapter_cache ("" = adapters off); the gpu worker
    # holds up to max_loras of them at once, each of rank <= max_lora_rank.
    adapter_cache: str = ""
    max_loras: int = 8
    max_lora_rank: int = 16
    # HTTP /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters from any folder under
    # a name of the caller's choosing (vLLM's flag; needs adapter_cache for the slots).
    allow_runtime_lora_updating: bool = False
    # Speculative decoding (`proto.speculative`): a JSON object as vLLM spells it ("": off).
    speculative_config: str = ""
    # What the model is served for (vLLM's --runner): "generate" (text), or "pooling"
    # (embeddings, rerank and score: prefill-only batches, vectors back to the frontend, no
    # postproc workers; docs/DESIGN.md section 24).
    runner: str = "generate"
    # Image input on a vision-language model (`frontend.media.fetch`), vLLM's flags: images per
    # prompt as JSON ('{"image": N}'; "": `proto.vision.DEFAULT_IMAGE_LIMIT`), and the folder
    # file:// image URLs may read from ("": none).
    limit_mm_per_prompt: str = ""
    allowed_local_media_path: str = ""
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

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def node_ranks(self) -> range:
        """The gpu worker ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def worker(self) -> WorkerConfig:
        """The gpu worker's section: what building a rank's model runner reads."""
        return WorkerConfig(
            self.model, device=self.device, dtype=self.dtype, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, kv_cache_memory=self.kv_cache_memory,
            kv_cache_dtype=self.kv_cache_dtype, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, cuda_graphs=not self.enforce_eager,
            onednn=self.onednn, flash_attn=self.flash_attn,
            attention_backend=self.attention_backend, adapter_cache=self.adapter_cache,
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
            load_format=self.load_format,
            kv_offloading_gib=self.kv_offloading_size / self.tensor_parallel_size,
            speculative=parse_speculative(self.speculative_config),
            prefix_caching=self.enable_prefix_caching)

    def worker_role(self, rank: int) -> str:
        """A gpu worker rank's role name and process title: `gpu-worker R/N` under tensor
        parallelism, plain `gpu-worker` without."""
        if self.tensor_parallel_size == 1:
            return "gpu-worker"
        return f"gpu-worker {rank}/{self.tensor_parallel_size}"


@dataclass(frozen=True)
class WorkerConfig:
    """The gpu worker's settings (`ServerConfig.worker()`; tests and benchmarks build one
    directly): the model, its device and dtype, the KV cache, graphs, adapters and
    speculation.  The defaults are `ServerConfig`'s, but for adapters, which are off."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_memory: float = 0.0
    kv_cache_dtype: str = "auto"
    max_model_len: int = 0
    max_num_seqs: int = 64
    cuda_graphs: bool = True
    onednn: bool = True
    flash_attn: bool = True  # False: `auto` never picks flash_attn
    attention_backend: str = "auto"  # `gpu_worker.attention.registry` names them
    adapter_cache: str = ""  # "": adapters off
    max_loras: int = 0
    max_lora_rank: int = 16
    load_format: str = "auto"
    speculative: SpeculativeConfig | None = None
    kv_offloading_gib: float = 0.0  # this rank's host KV tier (0: off)
    # Whether the scheduler may serve prefix hits (a hybrid model then checkpoints its
    # recurrent states at block boundaries); off unless the server's flag says so.
    prefix_caching: bool = False


# field -> (lowest allowed, highest allowed or None); flags are the fields' names in kebab case.
_LIMITS: dict[str, tuple[float, float | None]] = {
    "port": (0, 65535), "metrics_port": (0, 65535), "http_port": (0, 65535),
    "num_scheduler_steps": (1, 1024), "max_num_seqs": (1, None),
    "max_num_batched_tokens": (0, None), "max_model_len": (0, None),
    "num_postproc_workers": (1, 64), "block_size": (1, 4096), "num_kv_blocks": (0, None),
    "kv_cache_memory": (0, None), "kv_offloading_size": (0, 1 << 20),
    "max_queued_requests": (1, None),
    "max_queued_tokens": (1, None), "max_stream_buffer_bytes": (0, None),
    "default_max_new_tokens": (1, None),
    "max_new_tokens": (1, None), "torch_threads": (0, None), "reserved_cpus": (-1, None),
    "plan_lead_ms": (0, None), "shutdown_timeout": (0, None), "step_timeout": (0, None),
    "liveness_timeout": (0.1, None),
    "tensor_parallel_size": (1, 1024), "nnodes": (1, 1024), "node_rank": (0, 1023),
    "guided_compile_timeout": (0.1, 3600),
    "max_loras": (1, 256), "max_lora_rank": (1, 512),
}


def config_problems(cfg: ServerConfig) -> list[str]:
    """What is wrong with `cfg`, each naming the flag and its limit (empty: nothing)."""
    out = []
    for name, (low, high) in _LIMITS.items():
        value = getattr(cfg, name)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            out.append(f"--{name.replace('_', '-')} must be {bound} (got {value})")
    ports = [("--port", cfg.port), ("--metrics-port", cfg.metrics_port),
             ("--http-port", cfg.http_port)]
    for i, (flag, port) in enumerate(ports):
        for other, taken in ports[:i]:
            if port and port == taken:
                out.append(f"{flag} {port} must differ from {other} (0 turns it off)")
    out += _agent_problems(cfg)
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        out.append(f"--kv-cache-dtype {cfg.kv_cache_dtype!r} is not one of "
                   f"{', '.join(KV_CACHE_DTYPES)} (fp8 is e4m3; e5m2 is not supported)")
    out += _attention_problems(cfg)
    if cfg.scheduling_policy not in SCHEDULING_POLICIES:
        out.append(f"--scheduling-policy {cfg.scheduling_policy!r} is not one of "
                   f"{', '.join(SCHEDULING_POLICIES)}")
    if cfg.allow_runtime_lora_updating and not cfg.adapter_cache:
        out.append("--allow-runtime-lora-updating needs --adapter-cache DIR (the adapters' "
                   "slots are LoRA serving's)")
    if cfg.default_max_new_tokens > cfg.max_new_tokens:
        out.append(f"--default-max-new-tokens ({cfg.default_max_new_tokens}) must not exceed "
                   f"--max-new-tokens ({cfg.max_new_tokens})")
    out += speculative_problems(cfg.speculative_config, cfg.model)
    out += _runner_problems(cfg)
    try:
        parse_kv_events(cfg.kv_events_config)
    except ValueError as exc:
        out.append(str(exc))
    if cfg.kv_offloading_size and not cfg.enable_prefix_caching:
        out.append("--kv-offloading-size needs prefix caching (the host tier is indexed by "
                   "the prefix cache's block hashes): drop --no-prefix-caching")
    out += _vision_problems(cfg)
    return out + _parallel_problems(cfg)


# --scheduling-policy's values (`scheduler.priority` reads them).
SCHEDULING_POLICIES = ("fcfs", "priority")

# --kv-cache-dtype's values (`gpu_worker.attention.kv_cache` maps them; a test keeps the
# lists equal).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# --attention-backend's values: "auto" and the names in `gpu_worker.attention.registry`'s
# BACKENDS (a test keeps the lists equal; a new backend adds its name here too).
ATTENTION_BACKENDS = ("auto", "flash", "triton", "flex", "sdpa")

# The parsers openai_api/agents/ has (tool_parsers.TOOL_PARSERS, reasoning.REASONING_PARSERS;
# a test keeps the lists equal): proto/ imports nothing of ours.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


# --runner's values (vLLM's names).
RUNNERS = ("generate", "pooling")


def _runner_problems(cfg: ServerConfig) -> list[str]:
    if cfg.runner not in RUNNERS:
        return [f"--runner {cfg.runner!r} is not one of {', '.join(RUNNERS)}"]
    if cfg.runner == "pooling" and cfg.speculative_config:
        return ["--speculative-config needs --runner generate: pooling requests generate "
                "nothing"]
    if cfg.runner == "pooling" and cfg.nnodes > 1:
        return ["--runner pooling runs its tensor-parallel ranks on one host (--nnodes 1)"]
    if cfg.runner == "pooling" and cfg.adapter_cache:
        return ["--adapter-cache needs --runner generate (adapters are not served for "
                "pooling models)"]
    return []


def _vision_problems(cfg: ServerConfig) -> list[str]:
    out = []
    try:
        image_limit(cfg.limit_mm_per_prompt)
    except ValueError as exc:
        out.append(str(exc))
    return out


def _attention_problems(cfg: ServerConfig) -> list[str]:
    if cfg.attention_backend not in ATTENTION_BACKENDS:
        return [f"--attention-backend {cfg.attention_backend!r} is not one of "
                f"{', '.join(ATTENTION_BACKENDS)}"]
    if cfg.attention_backend == "flash" and not cfg.flash_attn:
        return ["--attention-backend flash contradicts --no-flash-attn (which keeps auto "
                "from picking flash)"]
    return []


def _agent_problems(cfg: ServerConfig) -> list[str]:
    out = []
    for flag, value, names in (("--tool-call-parser", cfg.tool_call_parser, TOOL_CALL_PARSERS),
                               ("--reasoning-parser", cfg.reasoning_parser, REASONING_PARSERS)):
        if value and value not in names:
            out.append(f"{flag} {value!r} is not one of {', '.join(names)}")
    if cfg.enable_auto_tool_choice and not cfg.tool_call_parser:
        out.append("--enable-auto-tool-choice needs --tool-call-parser NAME (one of "
                   f"{', '.join(TOOL_CALL_PARSERS)})")
    return out


def _parallel_problems(cfg: ServerConfig) -> list[str]:
    out = []
    tp, nodes = cfg.tensor_parallel_size, cfg.nnodes
    if tp >= 1 and nodes >= 1 and tp % nodes:
        out.append(f"--tensor-parallel-size ({tp}) must be a multiple of --nnodes ({nodes}): "
                   f"every node runs the same number of ranks")
    if cfg.node_rank >= nodes >= 1:
        out.append(f"--node-rank must be below --nnodes ({nodes}) (got {cfg.node_rank})")
    if nodes > 1 and not cfg.dist_init_addr:
        out.append("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's host and a free "
                   "port, reachable from every node)")
    if cfg.dist_init_addr and not _host_port(cfg.dist_init_addr):
        out.append(f"--dist-init-addr must be HOST:PORT with a port between 1 and 65534 "
                   f"(got {cfg.dist_init_addr!r})")
    return out


def _host_port(addr: str) -> tuple[str, int] | None:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        return None
    return host.strip("[]"), int(port)


def dist_host_port(cfg: ServerConfig) -> tuple[str, int]:
    """(host, port) of `--dist-init-addr` (validated when the config was built)."""
    hp = _host_port(cfg.dist_init_addr)
    if hp is None:
        raise ValueError(f"--dist-init-addr {cfg.dist_init_addr!r} is not HOST:PORT")
    return hp


def plans_address(cfg: ServerConfig) -> str:
    """Where gpu worker rank 0 publishes plans to the other ranks.

    On one host, the launcher's ipc socket; across hosts, TCP on rank 0's host (the
    rendezvous host) at the rendezvous port + 1, so a node needs no address but
    `--dist-init-addr`.
    """
    if cfg.nnodes == 1 and cfg.addresses.worker_plans:
        return cfg.addresses.worker_plans
    host, port = dist_host_port(cfg)
    return f"tcp://{host}:{port + 1}"


@dataclass(frozen=True)
class ModelLimits:
    """What the gpu worker learned at load time and the other processes need."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
