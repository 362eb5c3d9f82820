"""Tandem: an LLM serving engine (`tandem serve`), and its offline Python API.

    from tandem_serve import LLM, SamplingParams

The names are imported on first use (PEP 562), so the processes, which import only their own
packages (`tandem_serve.scheduler`, ...), never load the offline API or what it imports.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem_serve.tandem.offline.llm import LLM
    from tandem_serve.tandem.offline.params import (
        CompletionOutput,
        Logprob,
        RequestOutput,
        SamplingParams,
    )

_EXPORTS = {
    "LLM": "tandem_serve.tandem.offline.llm",
    "SamplingParams": "tandem_serve.tandem.offline.params",
    "RequestOutput": "tandem_serve.tandem.offline.params",
    "CompletionOutput": "tandem_serve.tandem.offline.params",
    "Logprob": "tandem_serve.tandem.offline.params",
}
__all__ = ["CompletionOutput", "LLM", "Logprob", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem_serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
