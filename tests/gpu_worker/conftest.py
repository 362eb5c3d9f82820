"""What every gpu worker test module shares."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The models and tensors here are tiny; on a shared 2-core box intra-op threads only add
    # barrier waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
