"""The `tandem` command: one parser for every subcommand; heavy imports happen lazily.

Environment variables are read here and nowhere else: every server flag takes its default
from `TANDEM_<FLAG>` (e.g. `TANDEM_MODEL`, `TANDEM_PORT`, `TANDEM_NUM_SCHEDULER_STEPS`,
`TANDEM_ASYNC_POSTPROC=false`, `TANDEM_SCHEDULER_ADDR` for `run-role`), which is how the
docker-compose services are configured; `TANDEM_FAULT` arms fault injection for tests
(`ipc.faults`; also the hidden flag `--fault`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable

from tandem_serve.proto.config import Addresses, ServerConfig


def cache_root() -> str:
    """Tandem's cache folder: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem (~/.cache)."""
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default,
                   help=help)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig(model="")
    p.add_argument("--model", default="",
                   help="Hugging Face model folder (default: the embedded tiny model)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--dtype", default=d.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                   help="K: decode steps per plan (1 = no multi-step)")
    _bool_flag(p, "async-postproc", d.async_postproc,
               "overlap postprocessing with the next plan (--no-async-postproc: sync baseline)")
    _bool_flag(p, "pace-plans", d.pace_plans,
               "async mode: build plan n+1 near the end of plan n (the worker says when), so "
               "requests that arrive during plan n join plan n+1 (--no-pace-plans: as soon "
               "as plan n is sent)")
    p.add_argument("--plan-lead-ms", type=float, default=d.plan_lead_ms,
                   help="with --pace-plans: how much of plan n's work is left, at least, when "
                        "the worker asks for plan n+1 (covers building and sending it)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step: decoding rows first, prefill chunks in the rest "
                        "(0: 160 on a CPU device, 512 on CUDA; a prefill token counts more at "
                        "long contexts; with --prefill-phase per plan, 0: 2048)")
    _bool_flag(p, "prefill-phase", d.prefill_phase,
               "baseline: prefill each plan's chunks in a forward of their own before its "
               "decode steps (decoding rows wait for it), instead of inside the steps")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="0: the model's max_position_embeddings")
    p.add_argument("--num-postproc-workers", type=int, default=d.num_postproc_workers)
    _bool_flag(p, "shm-ring", d.shm_ring, "token batches over shared memory (else ZeroMQ)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                   help="KV cache size in GiB (when --num-kv-blocks is 0)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="KV cache element type: auto (the model dtype) or fp8 (= fp8_e4m3: "
                        "float8 e4m3, scale 1.0, twice the blocks of bfloat16 per GiB)")
    _bool_flag(p, "prefix-caching", d.enable_prefix_caching, "automatic prefix caching")
    p.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size,
                   metavar="GIB",
                   help="host-memory KV tier: GiB of host memory (summed over tensor-parallel "
                        "ranks; pinned on CUDA) that blocks evicted from the device cache move "
                        "to, and come back from instead of being recomputed (0: off)")
    p.add_argument("--kv-events-config", default=d.kv_events_config, metavar="JSON",
                   help='publish prefix-cache events as vLLM does: {"enable_kv_cache_events": '
                        'true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": ""} (default: off)')
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests)
    p.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens)
    p.add_argument("--scheduling-policy", default=d.scheduling_policy,
                   choices=["fcfs", "priority"],
                   help="the waiting queue's order: fcfs, or priority (a request's priority "
                        "field, lower first, ties by arrival; a higher-priority request "
                        "preempts lower-priority running ones when seats or KV run out)")
    p.add_argument("--max-stream-buffer-bytes", type=int, default=d.max_stream_buffer_bytes,
                   help="output held for a client that stopped reading before its request is "
                        "cancelled with RESOURCE_EXHAUSTED (0: no limit)")
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="the largest max_new_tokens a request may ask for")
    _bool_flag(p, "include-stop-sequence", d.include_stop_sequence,
               "default for requests that leave include_stop_sequence unset")
    p.add_argument("--torch-threads", type=int, default=d.torch_threads,
                   help="gpu worker's torch threads (0: one per core it is pinned to)")
    _bool_flag(p, "enforce-eager", d.enforce_eager,
               "CUDA: launch every decode step from Python, no CUDA graphs")
    _bool_flag(p, "onednn", d.onednn,
               "CPU float32: linear layers through oneDNN with pre-packed weights")
    p.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape, made on the device "
                        "(benchmarks without a checkpoint)")
    p.add_argument("--attention-backend", default=d.attention_backend, metavar="NAME",
                   help="how the gpu worker attends: auto (flash where flash_attn serves, "
                        "else flex on CUDA, else sdpa), sdpa (torch SDPA over gathered "
                        "blocks; mixed steps split), flex (mixed steps in one FlexAttention "
                        "call), flash (flash_attn 2 reads the paged cache: CUDA, 16-bit, "
                        "--block-size a multiple of 256)")
    _bool_flag(p, "flash-attn", d.flash_attn,
               "--attention-backend auto may pick flash_attn (--no-flash-attn: never)")
    p.add_argument("--reserved-cpus", type=int, default=d.reserved_cpus,
                   help="CPU device: cores kept for the other processes, the gpu worker "
                        "pinned to the rest (-1: 1 on a host with ≥ 2 cores; 0: no pinning)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="split the model over this many gpu worker ranks (processes) joined "
                        "by torch.distributed: NCCL on CUDA, gloo on CPU")
    p.add_argument("--nnodes", type=int, default=d.nnodes,
                   help="hosts the tensor-parallel ranks are spread over (each runs "
                        "--tensor-parallel-size / --nnodes ranks)")
    p.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this host's index among --nnodes (0: the host of rank 0 and the "
                        "frontend; others: `tandem run-role gpu-worker --node-rank R`)")
    p.add_argument("--dist-init-addr", default=d.dist_init_addr,
                   help="HOST:PORT of the torch.distributed rendezvous on rank 0's host "
                        "(PORT + 1 carries the plans); default on one host: a free local port")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM, seconds in-flight requests may take before they are "
                        "cancelled")
    p.add_argument("--step-timeout", type=float, default=d.step_timeout,
                   help="a plan unfinished after this many seconds means a hung gpu worker: "
                        "its stack is logged and the server exits non-zero (0: off)")
    p.add_argument("--guided-cache-dir", default=os.path.join(cache_root(), "guided"),
                   help="compiled guided-decoding constraints are kept here across restarts "
                        "('' = in memory only; default: <cache folder>/guided)")
    p.add_argument("--guided-compile-timeout", type=float, default=d.guided_compile_timeout,
                   help="seconds one constraint may take to compile; a longer one is stopped "
                        "and its request gets INVALID_ARGUMENT")
    _bool_flag(p, "guided-precompile-json", d.guided_precompile_json,
               "compile format=JSON (any JSON object, seconds to compile) in the background "
               "once the server is ready, unless the cache has it")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port)
    p.add_argument("--http-port", type=int, default=d.http_port,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on --host; 0: off")
    _bool_flag(p, "enable-control-endpoints", d.enable_control_endpoints,
               "HTTP: the rollout controls POST /sleep?level=N, /wake_up, /pause, /resume, "
               "/reset_prefix_cache, /load_weights and GET /is_sleeping (404 without)")
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="the model name HTTP clients send (default: the model folder's name)")
    _bool_flag(p, "enable-auto-tool-choice", d.enable_auto_tool_choice,
               "HTTP: tool_choice 'auto' (the default with tools): calls parsed out of the "
               "model's text by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=d.tool_call_parser, metavar="NAME",
                   help="how the model writes tool calls: hermes (Qwen, Hermes), llama3_json, "
                        "mistral")
    p.add_argument("--reasoning-parser", default=d.reasoning_parser, metavar="NAME",
                   help="HTTP: split <think>...</think> into reasoning_content: deepseek_r1, "
                        "qwen3")
    p.add_argument("--chat-template", default=d.chat_template, metavar="FILE",
                   help="a chat template (a file, or the template's text) replacing the "
                        "checkpoint's")
    p.add_argument("--adapter-cache", default=d.adapter_cache, metavar="DIR",
                   help="LoRA adapters: a request's adapter_id (over HTTP: its model) names "
                        "the PEFT adapter folder DIR/<adapter_id> (default: adapters off)")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters the gpu worker holds at once (least recently used ones "
                        "no running request uses make room)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest adapter rank served (the device cost per token grows "
                        "with it)")
    _bool_flag(p, "allow-runtime-lora-updating", d.allow_runtime_lora_updating,
               "HTTP POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): serve a "
               "PEFT folder under a name of the caller's choosing (needs --adapter-cache)")
    p.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2} (default: off)')
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-client-ca", default="")
    p.add_argument("--api-key", default=d.api_key, metavar="KEY",
                   help="every /v1/* route (and the control endpoints) and every gRPC service "
                        "but health need `Authorization: Bearer KEY`; prefer TANDEM_API_KEY, "
                        "which `ps` does not show (default: open)")
    p.add_argument("--otlp-traces-endpoint", default=d.otlp_traces_endpoint, metavar="URL",
                   help="export one OpenTelemetry span per request (gen_ai.* attributes) to "
                        "this OTLP/HTTP collector, e.g. http://otel-collector:4318/v1/traces")
    p.add_argument("--liveness-timeout", type=float, default=d.liveness_timeout,
                   metavar="SECONDS",
                   help="GET /live answers 503 when requests are open and no engine plan has "
                        "completed for this long (a wedged gpu worker or scheduler)")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--fault", default="", help=argparse.SUPPRESS)
    _env_defaults(p)


def _env_defaults(p: argparse.ArgumentParser) -> None:
    """`TANDEM_<DEST>` overrides the default of every flag already on `p`."""
    for action in p._actions:
        value = os.environ.get(f"TANDEM_{action.dest.upper()}")
        if value is None or action.dest == "help":
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        elif action.type is not None:
            # A string default: argparse converts it only when the flag is not given, so a
            # value that does not parse stops only the commands that would use it.
            action.default = value
            convert = action.type
            assert callable(convert), f"--{action.dest}: a flag type must be callable"
            action.type = _EnvValue(convert, f"TANDEM_{action.dest.upper()}", value)
        else:
            action.default = value


class _EnvValue:
    """A flag's type that names the environment variable when its value does not parse."""

    def __init__(self, convert: Callable[[str], object], name: str, value: str) -> None:
        self.convert, self.name, self.value = convert, name, value
        self.__name__ = getattr(convert, "__name__", "value")  # argparse's messages use it

    def __call__(self, text: str) -> object:
        try:
            return self.convert(text)
        except (TypeError, ValueError) as exc:
            if text != self.value:
                raise
            hint = (" (Kubernetes sets <SERVICE>_PORT=tcp://... for a Service named tandem: "
                    "set enableServiceLinks: false)") if text.startswith("tcp://") else ""
            raise argparse.ArgumentTypeError(
                f"{self.name}={text!r} is not a valid {self.__name__}{hint}") from exc


def add_role_arguments(p: argparse.ArgumentParser) -> None:
    """Peer addresses for roles started one by one (tcp:// across containers)."""
    p.add_argument("--frontend-addr", default="", help="the frontend's inbox, e.g. tcp://frontend:5550")
    p.add_argument("--scheduler-addr", default="")
    p.add_argument("--worker-addr", default="")
    p.add_argument("--postproc-addrs", default="", help="comma-separated, in index order")
    p.add_argument("--supervisor-addr", default="",
                   help="where roles report failures (default: frontend port - 1)")
    _env_defaults(p)


def role_config(args: argparse.Namespace) -> ServerConfig:
    """A standalone role's config: server flags plus the peers' addresses."""
    needed: tuple[str, ...] = ("frontend_addr", "scheduler_addr", "worker_addr",
                               "postproc_addrs")
    if args.role == "gpu-worker" and args.node_rank > 0:
        needed = ()  # tensor-parallel ranks of another host: rank 0 is all they talk to
    missing = [n for n in needed if not getattr(args, n)]
    if missing:
        raise SystemExit(f"run-role without --config-file needs "
                         f"{', '.join('--' + m.replace('_', '-') for m in missing)} "
                         f"(or TANDEM_{missing[0].upper()})")
    postproc = tuple(a for a in args.postproc_addrs.split(",") if a)
    supervisor = args.supervisor_addr or (
        _port_offset(args.frontend_addr, -1) if args.frontend_addr else "")
    addr = Addresses(scheduler_inbox=args.scheduler_addr, frontend_inbox=args.frontend_addr,
                     worker_inbox=args.worker_addr, postproc_inboxes=postproc,
                     token_pub="", supervisor=supervisor)
    base = config_from_args(args)
    return base.replace(addresses=addr, standalone=True, shm_ring=False,
                        num_postproc_workers=len(postproc) or base.num_postproc_workers)


def _port_offset(addr: str, delta: int) -> str:
    head, port = addr.rsplit(":", 1)
    return f"{head}:{int(port) + delta}"


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's config; a flag out of range exits with status 2 naming it and its limit."""
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["enable_prefix_caching"] = args.prefix_caching
    if values.get("adapter_cache"):  # every process reads it, from its own working folder
        values["adapter_cache"] = os.path.abspath(values["adapter_cache"])
    template = values.get("chat_template")
    if template and os.path.isfile(template):
        values["chat_template"] = os.path.abspath(template)
    elif template and not any(mark in template for mark in ("{{", "{%")):
        print(f"tandem: error: --chat-template {template!r} does not exist (a file, or the "
              "template's own text)", file=sys.stderr)
        raise SystemExit(2)
    try:
        cfg = ServerConfig(**values)
    except ValueError as e:  # before any model is built
        print(f"tandem: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if cfg.model:
        return cfg
    from tandem_serve.harness.tiny_model import ensure_default_model

    return cfg.replace(model=str(ensure_default_model(in_subprocess=True)))


# ---------------------------------------------------------------------- subcommands


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem_serve.ipc.process import set_title, setup_logging

    setup_logging("frontend", args.log_level)
    set_title("tandem: frontend")
    cfg = config_from_args(args)
    from tandem_serve.tandem.launcher import serve

    return serve(cfg)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from tandem_serve.ipc.process import setup_logging
    from tandem_serve.tandem.offline import run_batch

    setup_logging("frontend", args.log_level)
    return run_batch.run(config_from_args(args), args)


def cmd_run_role(args: argparse.Namespace) -> int:
    from tandem_serve.ipc.process import exit_now, init_child

    if args.config_file:  # started by the launcher
        with open(args.config_file) as f:
            cfg = ServerConfig.from_json(f.read())
    else:
        cfg = role_config(args)
    if args.role == "frontend":
        from tandem_serve.ipc.process import set_title, setup_logging
        from tandem_serve.tandem.launcher import serve

        setup_logging("frontend", cfg.log_level)
        set_title("tandem: frontend")
        return serve(cfg)
    role = args.role if args.role != "postproc" else f"postproc {args.index}"
    rank = args.index
    if args.role == "gpu-worker":
        if not args.config_file:  # on its own: this host's tensor-parallel rank(s)
            if cfg.ranks_per_node > 1:
                from tandem_serve.tandem.tp_node import run_node  # each rank a process of its own

                return run_node(cfg)
            rank = cfg.node_rank
        role = cfg.worker_role(rank)
    init_child(role, cfg, args.parent_pid, rank % cfg.ranks_per_node)
    exit_now(_run_child(args, cfg, role, rank))
    return 0  # not reached


def _run_child(args: argparse.Namespace, cfg: ServerConfig, role: str, rank: int) -> int:
    """Run a scheduler, gpu worker or postproc worker until it ends; its exit status."""
    from tandem_serve.ipc.peers import PeerLost
    from tandem_serve.ipc.process import StartupError, report_failure

    try:
        if args.role == "scheduler":
            from tandem_serve.scheduler.main import run_scheduler

            run_scheduler(cfg)
        elif args.role == "gpu-worker":
            from tandem_serve.gpu_worker.main import run_gpu_worker

            run_gpu_worker(cfg, rank)
        elif args.role == "postproc":
            from tandem_serve.postproc_worker.main import run_postproc

            run_postproc(cfg, args.index)
    except SystemExit as exc:  # SIGTERM: clean exit after the finally blocks ran
        return 0 if exc.code in (None, 0, 143) else int(exc.code or 1)
    except PeerLost as exc:  # on its own: its set is gone; the orchestrator restarts it fresh
        logging.getLogger("tandem").error("%s", exc)
        return 1
    except StartupError as exc:  # the user's to fix: one line, the traceback only at debug
        # The launcher stops every child now; its SIGTERM must not turn this quiet exit
        # into a SystemExit traceback from whatever atexit hook is running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.getLogger("tandem").debug("start-up failed", exc_info=True)
        report_failure(role, cfg, exc)
        if cfg.standalone:  # no launcher to print it
            print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the launcher hears why before our peers' exits confuse it
        report_failure(role, cfg, exc)
        raise
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from tandem_serve.harness import tiny_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return tiny_model.main(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem_serve.tandem.client_cli import generate_main

    return generate_main(args)


def cmd_health(args: argparse.Namespace) -> int:
    from tandem_serve.tandem.client_cli import health_main

    return health_main(args)


def cmd_bench_ipc(args: argparse.Namespace) -> int:
    from tandem_serve.bench.ipc import main as bench_ipc

    return bench_ipc.main(args.rest)


# `tandem bench NAME`: the module `bench.MODULE` with `add_arguments(parser)` and `main(args)`.
BENCHMARKS = (  # (NAME, MODULE, help)
    ("serve", "serve.main", "vLLM-style serving benchmark against a server"),
    ("step", "step.main", "decode ms/step at batch 1/8/32/64 next to HF generate()"),
    ("postproc", "postproc.main", "postproc tokens/s next to decode tokens/s"),
    ("soak", "soak.main", "steady load for minutes; RSS growth of every process"),
    ("robustness", "robustness.main", "overload, stalled and vanishing clients, role restarts"),
    ("ab", "ab.main", "sync/async x K table, each arm on a fresh server"),
    ("lora", "lora.main", "TPOT and throughput with LoRA adapters vs the base model"),
    ("guided", "guided.main", "TPOT and throughput with guided requests, per kind"),
    ("stall", "stall.main", "decode streams' worst inter-token gap while long prompts arrive"),
    ("spec", "spec.main", "speculative decoding vs none: acceptance, TPOT, copy and plain prompts"),
    ("offload", "offload.main", "host KV tier vs device cache alone: re-send and multi-turn TTFT"),
    ("report", "report.main", "rerun the benchmarks, rewrite docs/BENCHMARKS.md"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the gRPC and HTTP servers and all their processes")
    add_server_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run-role", help="run one process role (used by the launcher)")
    p.add_argument("role", choices=["frontend", "scheduler", "gpu-worker", "postproc"])
    p.add_argument("--config-file", default="",
                   help="written by the launcher; else the server flags and peer addresses")
    add_server_arguments(p)
    add_role_arguments(p)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.set_defaults(func=cmd_run_role)

    from tandem_serve.tandem.offline import run_batch

    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, without "
                                         "a server")
    add_server_arguments(p)
    run_batch.add_arguments(p)
    p.set_defaults(func=cmd_run_batch)

    p = sub.add_parser("make-tiny-model", help="write the tiny default checkpoint")
    from tandem_serve.harness.tiny_model import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_make_tiny_model)

    from tandem_serve.tandem.client_cli import add_generate_arguments, add_health_arguments

    p = sub.add_parser("generate", help="send a prompt and stream the answer")
    add_generate_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("health", help="exit 0 when the server is SERVING")
    add_health_arguments(p)
    p.set_defaults(func=cmd_health)

    from tandem_serve.tandem import profile_cli

    p = sub.add_parser("profile", help="record spans in every process; trace, summary, PNG")
    profile_cli.add_arguments(p)
    p.set_defaults(func=profile_cli.main)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                       required=True)
    for name, module_name, help_text in BENCHMARKS:
        module = importlib.import_module(f"tandem_serve.bench.{module_name}")
        p = bench.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    p = bench.add_parser("ipc", help="ring vs ZeroMQ latency and idle CPU")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench_ipc)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    from tandem_serve.ipc.process import StartupError

    try:
        return func(args)
    except StartupError as exc:  # like argparse's usage errors: one line, status 2
        logging.getLogger("tandem").debug("start-up failed", exc_info=True)
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
