"""The peers `tandem bench ab --peers` runs the same workload against: `transformers serve
--continuous-batching` (its own server, driven over HTTP) and static-batch `generate()` in
this process (the bound with no server at all)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

from tandem_serve.bench.ab.tables import PEER_NAMES
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.harness.processes import CpuMeter, free_port

PEERS = tuple(PEER_NAMES)


def transformers_cli() -> str:
    """The `transformers` console script of this interpreter's environment."""
    here = os.path.join(os.path.dirname(sys.executable), "transformers")
    return here if os.path.exists(here) else "transformers"


def run_transformers_serve(model: str, work: Workload, timeout: float = 300.0
                           ) -> dict[str, Any]:
    """The same workload against `transformers serve --continuous-batching` on `model`."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [transformers_cli(), "serve", "--continuous-batching", "--device", "cpu",
           "--port", str(port), model]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_health(proc, port, timeout)
        first_completion(port, model)  # it loads the model on the first request
        meter: list[CpuMeter] = []
        result = work.run(backend="transformers-serve", port=port, model=model,
                          served_model_name=model,
                          warmed=lambda: meter.append(CpuMeter(proc.pid, "transformers serve")))
        result["cpu_s"] = meter[0].stop()
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_health(proc: subprocess.Popen, port: int, timeout: float) -> None:
    """Until transformers serve's /health answers; an error once it exits or time is up."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited with {proc.returncode} "
                               "(is the bench extra installed?)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError("transformers serve did not become ready") from None
            time.sleep(0.5)


def first_completion(port: int, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


def run_hf_generate(model: str, work: Workload) -> dict[str, Any]:
    """Static batches of `generate()` in this process: the bound with no server at all."""
    return work.run(backend="hf-generate", model=model, device="cpu")


def run_peer(name: str, model: str, work: Workload) -> dict[str, Any]:
    if name == "transformers-serve":
        return run_transformers_serve(model, work)
    if name == "hf-generate":
        return run_hf_generate(model, work)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
