"""Triton under its interpreter for the CPU tests: the kernels a GPU runs, run on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated (its module's import: reloaded if
something imported it compiled before) and again in lazy imports at the first launch, so it
is set around the import and around the tests that launch kernels, and restored after.
With a CUDA device the kernels run compiled and nothing is set.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "tandem_serve.gpu_worker.attention.triton_kernels"


@contextlib.contextmanager
def interpreter() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside, when there is no CUDA device; restored on exit."""
    saved = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def load_kernels() -> ModuleType:
    """The attention kernels' module, under the interpreter when there is no CUDA device
    (skips the test where triton is not installed)."""
    with interpreter():
        pytest.importorskip("triton", reason="triton is not installed (the `test` extra)")
        mod = importlib.import_module(KERNELS)
        if DEVICE == "cpu" and type(mod._attention_kernel).__name__ != "InterpretedFunction":
            mod = importlib.reload(mod)
        return mod


def use_backend(request: pytest.FixtureRequest, name: str) -> str:
    """`name`, after readying the interpreter for it when it is the Triton backend (the
    `triton_interpreter` fixture, tests/gpu_worker/conftest.py)."""
    if name == "triton":
        request.getfixturevalue("triton_interpreter")
    return name
