"""Triton for the tests: the kernels a GPU runs.  Without a CUDA device they run under
Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by tests/conftest.py before
anything imports triton: it is read when a kernel is decorated).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "tandem_serve.gpu_worker.attention.triton_kernels"


def load_kernels() -> ModuleType:
    """The attention kernels' module (skips the test where triton is not installed)."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra)")
    return importlib.import_module(KERNELS)


def use_backend(request: pytest.FixtureRequest, name: str) -> str:
    """`name`, after readying the Triton backend when it is that one (the
    `triton_interpreter` fixture, tests/gpu_worker/conftest.py)."""
    if name == "triton":
        request.getfixturevalue("triton_interpreter")
    return name
