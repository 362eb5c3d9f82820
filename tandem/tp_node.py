"""`tandem run-role gpu-worker` on a host that runs several tensor-parallel ranks on its own.

Under `tandem serve` the launcher starts and watches every rank of its host.  A host of a
multi-node deployment (`--nnodes M --node-rank R`, R > 0), or a container running several
ranks, has no launcher: this starts the host's ranks as child processes (one per rank,
pinned like the launcher pins them) and watches them the way the launcher does.  The first
rank to exit decides: the others are stopped (SIGTERM, then SIGKILL) and this exits with
that rank's status, non-zero unless the set was shut down cleanly, so an orchestrator's
restart policy brings the host back.  With one rank per host none of this is needed: the
rank runs in the `run-role` process itself.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tandem_serve.ipc.process import CLI, set_title, setup_logging, split_cpus
from tandem_serve.proto.config import ServerConfig

log = logging.getLogger("tandem.node")

POLL_S = 0.1
STOP_TIMEOUT_S = 2.0


def free_local_addr() -> str:
    """A rendezvous address on this host (the port is free now; the race is the usual one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def node_config(cfg: ServerConfig, run_dir: str) -> ServerConfig:
    """The ranks' config: a rendezvous and a plan socket on this host when all ranks are here."""
    cfg = cfg.replace(run_dir=run_dir)
    if cfg.nnodes == 1:
        addr = dataclasses.replace(cfg.addresses, worker_plans=f"ipc://{run_dir}/worker-plans")
        cfg = cfg.replace(addresses=addr, dist_init_addr=cfg.dist_init_addr or free_local_addr())
    return split_cpus(cfg)


def start_rank(path: str, rank: int) -> subprocess.Popen:
    cmd = [*CLI, "run-role", "gpu-worker", "--config-file", path,
           "--index", str(rank), "--parent-pid", str(os.getpid())]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def stop(procs: dict[int, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for rank, p in procs.items():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank %d (pid %d) did not stop; killing it", rank, p.pid)
            p.kill()
            p.wait()


def watch(procs: dict[int, subprocess.Popen]) -> int:
    """Wait for the first rank to exit; stop the rest; its status (128 + signal if killed)."""
    while True:
        for rank, p in procs.items():
            rc = p.poll()
            if rc is None:
                continue
            if rc != 0:
                log.error("gpu worker rank %d (pid %d) exited with %d; stopping this host's "
                          "other ranks", rank, p.pid, rc)
                stop(procs)
                return rc if rc > 0 else 128 - rc
            # A clean exit (rank 0's Shutdown): the others are leaving too.
            others = [q for q in procs.values() if q is not p]
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while any(q.poll() is None for q in others) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            stop(procs)
            return max((q.returncode or 0) for q in procs.values())
        time.sleep(POLL_S)


def run_node(cfg: ServerConfig) -> int:
    set_title(f"tandem: gpu-worker node {cfg.node_rank}/{cfg.nnodes}")
    setup_logging(f"gpu-worker node {cfg.node_rank}", cfg.log_level)
    run_dir = tempfile.mkdtemp(prefix=f"tandem-{os.getpid()}-")
    procs: dict[int, subprocess.Popen] = {}

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cfg = node_config(cfg, run_dir)
        path = os.path.join(run_dir, "config.json")
        with open(path, "w") as f:
            f.write(cfg.to_json())
        for rank in cfg.node_ranks():
            procs[rank] = start_rank(path, rank)
            log.info("started gpu worker rank %d (pid %d)", rank, procs[rank].pid)
        return watch(procs)
    except SystemExit as exc:
        log.info("stopping this host's ranks")
        stop(procs)
        return int(exc.code or 0) if exc.code != 128 + signal.SIGTERM else 0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
