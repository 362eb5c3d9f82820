"""The compose deployment's roles as separate processes, started exactly as the compose file
says (its commands and environment), with 127.0.0.1 in place of the service names."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rpc.client import GenerateOptions, TandemClient
from tests.e2e.server import ROOT, free_port
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

COMPOSE = pathlib.Path(ROOT) / "docker" / "docker-compose.yml"
ROLES = ["scheduler", "gpu-worker", "postproc-0", "postproc-1", "frontend"]
PROMPTS = [("Once upon a time", 12), ("The quick brown fox", 7)]


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
    argv, envs = {}, {}
    for name in ROLES:
        svc = services[name]
        env = {k: re.sub(r"tcp://([\w-]+):(\d+)", addr, interpolate(str(v)))
               for k, v in svc["environment"].items()}
        env["TANDEM_MODEL"] = model
        env["TANDEM_SUPERVISOR_ADDR"] = f"tcp://127.0.0.1:{free_port()}"
        cmd = [interpolate(str(c)) for c in svc["command"]]
        if name == "frontend":
            cmd[cmd.index("--port") + 1] = str(grpc_port)
            cmd[cmd.index("--host") + 1] = "127.0.0.1"
        argv[name], envs[name] = cmd, env
    supervisor = envs["frontend"]["TANDEM_SUPERVISOR_ADDR"]
    for env in envs.values():
        env["TANDEM_SUPERVISOR_ADDR"] = supervisor
    return argv, envs, grpc_port


@pytest.fixture(scope="module")
def hf_texts(tiny_model_dir: pathlib.Path) -> list[str]:
    return hf_greedy(tiny_model_dir, PROMPTS)


def test_roles_serve_like_compose_and_exit_when_the_scheduler_dies(
        tiny_model_dir: pathlib.Path, hf_texts: list[str]) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    argv, envs, port = localize(services, str(tiny_model_dir))
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ROLES:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", *argv[name]], cwd=ROOT,
                env={**os.environ, **envs[name], "TANDEM_LOG_LEVEL": "WARNING"},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = TandemClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while not client.is_serving():
            assert time.monotonic() < deadline, "roles did not become ready"
            assert all(p.poll() is None for p in procs.values())
            time.sleep(0.3)
        for (text, n), want in zip(PROMPTS, hf_texts, strict=True):
            got = "".join(r.text for r in client.stream(
                text, GenerateOptions(max_new_tokens=n, min_new_tokens=n)))
            assert got == want
        client.close()
        procs["scheduler"].send_signal(signal.SIGKILL)
        for name in ["frontend", "gpu-worker", "postproc-0", "postproc-1"]:
            code = procs[name].wait(timeout=20)
            assert code != 0, f"{name} exited {code} after losing the scheduler"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
