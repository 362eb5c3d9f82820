"""What every gpu worker test module shares."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.gpu_worker.runner_driver import checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The models and tensors here are tiny; on a shared 2-core box intra-op threads only add
    # barrier waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runner-ckpts")


@pytest.fixture(scope="session")
def llama(ckpt_root: Path) -> str:
    """The GQA llama checkpoint most runner tests drive (built once per run)."""
    return checkpoint(ckpt_root, "llama-gqa")
