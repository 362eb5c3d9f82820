"""The compose deployment's roles as local processes, without a Docker engine.

Each role is started exactly as `docker/docker-compose.yml` says (its command and
environment), with 127.0.0.1 and free ports in place of the service names, and
`RoleSet.restart_policy` plays compose's `restart: unless-stopped`: a role that exits is
started again (after compose's first back-off, 0.1 s).  `tandem bench robustness` uses it
to kill roles and watch the set come back, and the end-to-end tests to check it.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tandem_serve.harness.processes import free_port
from tandem_serve.ipc.process import CLI

# The real checkout, links resolved: the compose file is read from it and the roles run in it.
ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "docker-compose.yml"
ROLES = ["scheduler", "gpu-worker", "postproc-0", "postproc-1", "frontend"]
RESTART_DELAY = 0.1  # docker's first restart back-off


def interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` with an empty environment: the default."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), value)


def localize(services: dict, model: str) -> tuple[dict[str, list[str]], dict[str, dict], int]:
    """Each role's argv and environment, service names mapped to 127.0.0.1 and free ports."""
    ports: dict[str, int] = {}

    def addr(m: re.Match) -> str:
        key = f"{m.group(1)}:{m.group(2)}"
        ports.setdefault(key, free_port())
        return f"tcp://127.0.0.1:{ports[key]}"

    grpc_port = free_port()
    supervisor = f"tcp://127.0.0.1:{free_port()}"
    argv, envs = {}, {}
    for name in ROLES:
        svc = services[name]
        env = {k: re.sub(r"tcp://([\w-]+):(\d+)", addr, interpolate(str(v)))
               for k, v in svc["environment"].items()}
        env["TANDEM_MODEL"] = model
        env["TANDEM_SUPERVISOR_ADDR"] = supervisor
        cmd = [interpolate(str(c)) for c in svc["command"]]
        if name == "frontend":
            cmd[cmd.index("--port") + 1] = str(grpc_port)
            cmd[cmd.index("--host") + 1] = "127.0.0.1"
        argv[name], envs[name] = cmd, env
    return argv, envs, grpc_port


@dataclass
class Exit:
    role: str
    pid: int
    code: int
    at: float  # time.monotonic()


@dataclass
class RoleSet:
    """The roles of one compose deployment, each a subprocess of this one."""

    model: str
    log_dir: str
    env: dict[str, str] = field(default_factory=dict)  # on top of the compose environment
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    exits: list[Exit] = field(default_factory=list)
    _policy: threading.Thread | None = None
    _stopping: bool = False

    def __post_init__(self) -> None:
        import yaml

        services = yaml.safe_load(COMPOSE.read_text())["services"]
        self.argv, self.envs, self.port = localize(services, self.model)
        self.target = f"127.0.0.1:{self.port}"

    def start(self, role: str) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{role}.log"), "a")
        proc = subprocess.Popen([*CLI, *self.argv[role]],
                                cwd=ROOT, env={**os.environ, **self.envs[role], **self.env},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self.procs[role] = proc
        return proc

    def start_all(self) -> None:
        for role in ROLES:
            self.start(role)

    def restart_policy(self) -> None:
        """Start every role again when it exits, as compose's `unless-stopped` does."""
        self._policy = threading.Thread(target=self._restart_loop, name="restart-policy",
                                        daemon=True)
        self._policy.start()

    def _restart_loop(self) -> None:
        while not self._stopping:
            for role, proc in list(self.procs.items()):
                code = proc.poll()
                if code is not None and not self._stopping:
                    self.exits.append(Exit(role, proc.pid, code, time.monotonic()))
                    time.sleep(RESTART_DELAY)
                    if not self._stopping:
                        self.start(role)
            time.sleep(0.02)

    def kill(self, role: str, sig: int = signal.SIGKILL) -> int:
        proc = self.procs[role]
        proc.send_signal(sig)
        return proc.pid

    def exits_since(self, t0: float) -> list[Exit]:
        return [e for e in self.exits if e.at >= t0]

    def stop(self) -> None:
        self._stopping = True
        if self._policy is not None:
            self._policy.join(5)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log(self, role: str) -> str:
        return pathlib.Path(self.log_dir, f"{role}.log").read_text(errors="replace")


def wait_health(client: Any, serving: bool, timeout: float,
                watch: subprocess.Popen | None = None) -> float:
    """Seconds until the frontend's health is SERVING (or not); TimeoutError after `timeout`.

    With `watch`, a frontend process that exits meanwhile is an error too."""
    t0 = time.monotonic()
    while client.is_serving(timeout=1.0) != serving:
        if watch is not None and watch.poll() is not None:
            raise RuntimeError(f"the frontend exited with {watch.returncode}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"health not {'SERVING' if serving else 'NOT_SERVING'} after "
                               f"{timeout:g} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def wait_serving_anew(target: str, timeout: float) -> float:
    """Seconds until a server at `target` is SERVING, asking on a new channel each time: a
    channel whose server went away backs off its reconnects (1 s, 1.6 s, ...), which would
    count in the time measured."""
    from tandem_serve.rpc.client import TandemClient

    t0 = time.monotonic()
    while True:
        client = TandemClient(target)
        try:
            if client.is_serving(timeout=1.0):
                return time.monotonic() - t0
        finally:
            client.close()
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{target} not SERVING after {timeout:g} s")
        time.sleep(0.05)
