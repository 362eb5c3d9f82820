"""A gpu worker slow to start (a cold torch import on a loaded host, a big checkpoint) must not
fail the start-up: the postproc workers wait for its token ring as long as it takes.

Before, they gave up after a fixed 10 s, and one fresh-clone `make test` in five failed."""
from __future__ import annotations

import os
import pathlib

import pytest

from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

DELAY_S = 12  # longer than the fixed wait that used to fail the start-up


def test_a_gpu_worker_slower_to_start_than_any_fixed_wait(fast_model_dir: pathlib.Path,
                                                         tmp_path: pathlib.Path) -> None:
    # Python imports `sitecustomize` at start-up: here it delays the gpu worker alone,
    # before it has created anything, as a slow import would.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\n"
        "if sys.argv[1:3] == ['run-role', 'gpu-worker']:\n"
        f"    time.sleep({DELAY_S})\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    server = Server(str(fast_model_dir), env={"PYTHONPATH": path})
    try:
        server.wait_ready(timeout=DELAY_S + 120)
        out = list(server.client.stream("Once upon a time", GenerateOptions(max_new_tokens=4)))
        assert out[-1].generated_token_count == 4
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []
