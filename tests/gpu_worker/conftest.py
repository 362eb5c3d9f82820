"""What every gpu worker test module shares."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu_worker.runner_driver import checkpoint
from tests.gpu_worker.triton_utils import load_kernels


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread: None) -> None:
    """Every module here runs torch at one thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runner-ckpts")


@pytest.fixture(scope="session")
def llama(ckpt_root: Path) -> str:
    """The GQA llama checkpoint most runner tests drive (built once per run)."""
    return checkpoint(ckpt_root, "llama-gqa")


@pytest.fixture
def triton_interpreter() -> None:
    """The Triton attention backend can be built and run in this test (under Triton's
    interpreter when there is no CUDA device: tests/gpu_worker/triton_utils)."""
    load_kernels()
