"""Start-up mistakes a new user makes get one line and exit status 2, never a traceback."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess

import pytest

from tandem_serve.harness.processes import free_port
from tandem_serve.ipc.process import CLI

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def serve(*flags: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "serve", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tandem: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def test_model_folder_that_does_not_exist(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = serve("--model", str(missing), "--port", str(free_port()))
    line = assert_one_line_error(proc, "--model", str(missing), "does not exist",
                                 "config.json")
    assert proc.stderr.strip() == line  # nothing started, so nothing else was said


def test_folder_without_a_checkpoint(tmp_path: pathlib.Path) -> None:
    proc = serve("--model", str(tmp_path), "--port", str(free_port()))
    assert_one_line_error(proc, "--model", "no config.json")


def test_unsupported_architecture(tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    model = tmp_path / "gpt2-like"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    proc = serve("--model", str(model), "--port", str(free_port()))
    line = assert_one_line_error(proc, "unsupported architecture GPT2LMHeadModel",
                                 "LlamaForCausalLM", "Qwen3ForCausalLM")
    assert proc.stderr.strip() == line


def test_adapter_cache_that_is_not_a_folder(tmp_path: pathlib.Path,
                                            tiny_model_dir: pathlib.Path) -> None:
    proc = serve("--model", str(tiny_model_dir), "--port", str(free_port()),
                 "--adapter-cache", str(tmp_path / "nowhere"))
    assert_one_line_error(proc, "--adapter-cache", "nowhere", "is not a folder")


def test_port_in_use(tiny_model_dir: pathlib.Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = serve("--model", str(tiny_model_dir), "--port", str(port))
    line = assert_one_line_error(proc, f"--port {port}", "in use")
    assert proc.stderr.strip() == line


def test_http_port_in_use(tiny_model_dir: pathlib.Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = serve("--model", str(tiny_model_dir), "--port", str(free_port()),
                     "--http-port", str(port))
    line = assert_one_line_error(proc, f"--http-port {port}", "in use")
    assert proc.stderr.strip() == line


@pytest.mark.slow
def test_checkpoint_the_gpu_worker_cannot_load(tmp_path: pathlib.Path,
                                               tiny_model_dir: pathlib.Path) -> None:
    """Only loading finds a missing tensor: the gpu worker reports it in one line too."""
    model = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the checkpoint has no weights for the extra layer
    (model / "config.json").write_text(json.dumps(config))
    proc = serve("--model", str(model), "--port", str(free_port()), "--log-level", "WARNING")
    assert_one_line_error(proc, "--model", "missing weight")


def test_shape_that_does_not_split_over_the_ranks(tiny_model_dir: pathlib.Path) -> None:
    """Refused before any process starts, naming the shape and the flag."""
    proc = serve("--model", str(tiny_model_dir), "--port", str(free_port()),
                 "--tensor-parallel-size", "3")
    line = assert_one_line_error(proc, "cannot be split",
                                 "num_attention_heads 4 is not divisible by "
                                 "--tensor-parallel-size 3",
                                 "vocab_size 32000 is not divisible by --tensor-parallel-size 3")
    assert proc.stderr.strip() == line


@pytest.mark.parametrize("flags, expected", [
    (["--tensor-parallel-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"],
     "--tensor-parallel-size (3) must be a multiple of --nnodes (2)"),
    (["--tensor-parallel-size", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["--tensor-parallel-size", "2", "--dist-init-addr", "nohostport"],
     "--dist-init-addr must be HOST:PORT"),
    (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
      "h:1"], "start this host's ranks with `tandem run-role gpu-worker --node-rank 1"),
])
def test_parallel_flags_out_of_range(tiny_model_dir: pathlib.Path, flags: list[str],
                                     expected: str) -> None:
    proc = serve("--model", str(tiny_model_dir), "--port", str(free_port()), *flags)
    assert_one_line_error(proc, expected)


def test_attention_backend_that_does_not_exist() -> None:
    """Refused by the command line itself (the names are proto.config's, torch-free)."""
    proc = serve("--attention-backend", "nope", "--port", str(free_port()))
    line = assert_one_line_error(proc, "--attention-backend 'nope' is not one of auto, flash, "
                                       "triton, flex, sdpa")
    assert proc.stderr.strip() == line


@pytest.mark.slow
def test_attention_backend_that_cannot_serve_here(tiny_model_dir: pathlib.Path) -> None:
    """Only the gpu worker knows its device and libraries: flash on the CPU is one line from
    it, naming the flag, the backend and why, and nothing is served."""
    proc = serve("--model", str(tiny_model_dir), "--port", str(free_port()), "--device", "cpu",
                 "--attention-backend", "flash", "--log-level", "WARNING")
    assert_one_line_error(proc, "--attention-backend flash: ", "flash_attn")


def test_runner_pooling_with_a_folder_it_cannot_pool(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "t5-like"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["T5EncoderModel"],
                                                   "hidden_size": 8}))
    proc = serve("--model", str(model), "--runner", "pooling", "--port", str(free_port()))
    assert_one_line_error(proc, "--runner pooling", "T5EncoderModel", "BertModel")
