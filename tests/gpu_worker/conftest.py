"""What every gpu worker test module shares."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu_worker.runner_driver import checkpoint


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
