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
from typing import Any

from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.tandem.server_flags import add_server_flags


def cache_root() -> str:
    """Tandem's cache folder: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem (~/.cache)."""
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, cache_root())
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
    if values.get("allowed_local_media_path"):
        values["allowed_local_media_path"] = os.path.abspath(values["allowed_local_media_path"])
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
    ("pooling", "pooling.main", "embeddings through --runner pooling vs sentence-transformers"),
    ("vision", "vision.main", "image chats vs text chats of the same token count; encoder share"),
    ("offload", "offload.main", "host KV tier vs device cache alone: re-send and multi-turn TTFT"),
    ("report", "report.main", "rerun the benchmarks, rewrite docs/BENCHMARKS.md"),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser, or `only` that one's: each process of a server parses its
    command line (`run-role`), and the benchmarks' and tools' declarations would cost each
    of them a third of a second of imports."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        if only is None or only == name:
            _ADD[name](sub)
    return parser


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="start the gRPC and HTTP servers and all their processes")
    add_server_arguments(p)
    p.set_defaults(func=cmd_serve)


def _add_run_role(sub: Any) -> None:
    p = sub.add_parser("run-role", help="run one process role (used by the launcher)")
    p.add_argument("role", choices=["frontend", "scheduler", "gpu-worker", "postproc"])
    p.add_argument("--config-file", default="",
                   help="written by the launcher; else the server flags and peer addresses")
    add_server_arguments(p)
    add_role_arguments(p)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.set_defaults(func=cmd_run_role)


def _add_run_batch(sub: Any) -> None:
    from tandem_serve.tandem.offline import run_batch

    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, without "
                                         "a server")
    add_server_arguments(p)
    run_batch.add_arguments(p)
    p.set_defaults(func=cmd_run_batch)


def _add_make_tiny_model(sub: Any) -> None:
    from tandem_serve.harness.tiny_model import add_arguments

    p = sub.add_parser("make-tiny-model", help="write the tiny default checkpoint")
    add_arguments(p)
    p.set_defaults(func=cmd_make_tiny_model)


def _add_generate(sub: Any) -> None:
    from tandem_serve.tandem.client_cli import add_generate_arguments

    p = sub.add_parser("generate", help="send a prompt and stream the answer")
    add_generate_arguments(p)
    p.set_defaults(func=cmd_generate)


def _add_health(sub: Any) -> None:
    from tandem_serve.tandem.client_cli import add_health_arguments

    p = sub.add_parser("health", help="exit 0 when the server is SERVING")
    add_health_arguments(p)
    p.set_defaults(func=cmd_health)


def _add_profile(sub: Any) -> None:
    from tandem_serve.tandem import profile_cli

    p = sub.add_parser("profile", help="record spans in every process; trace, summary, PNG")
    profile_cli.add_arguments(p)
    p.set_defaults(func=profile_cli.main)


def _add_bench(sub: Any) -> None:
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


_ADD: dict[str, Callable[[Any], None]] = {
    "serve": _add_serve, "run-role": _add_run_role, "run-batch": _add_run_batch,
    "make-tiny-model": _add_make_tiny_model, "generate": _add_generate, "health": _add_health,
    "profile": _add_profile, "bench": _add_bench}
COMMANDS = tuple(_ADD)  # in `tandem --help`'s order


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None  # else the whole usage
    args = build_parser(command).parse_args(argv)
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
