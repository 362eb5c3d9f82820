"""Reading HF safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
import os
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _device_str(device: torch.device) -> str:
    # safe_open wants an explicit index for CUDA.
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


NESTED_LM = "model.language_model."
# Where multimodal folders nest the language model -> the causal LM's own prefix: Qwen3-VL
# and Qwen3.5 as published; Gemma 3 VL as published and as transformers 5 writes it
# (`language_model.model.*`, an untied head `language_model.lm_head.*`).
_NESTED = {NESTED_LM: "model.", "language_model.model.": "model.",
           "language_model.lm_head.": "lm_head."}


class SafetensorsCheckpoint:
    """Lazy view of a checkpoint's tensors: names and shapes without loading data.

    ``get`` loads one tensor straight onto ``device`` and casts it to ``dtype`` there.
    """

    def __init__(self, model_dir: str, device: torch.device) -> None:
        self.model_dir = model_dir
        self.device = device
        index_path = os.path.join(model_dir, INDEX_FILE)
        single_path = os.path.join(model_dir, SINGLE_FILE)
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path}: no weight_map")
            self._file_of = {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
        elif os.path.exists(single_path):
            self._file_of = {}
            with safe_open(single_path, framework="pt") as f:
                for k in f.keys():
                    self._file_of[k] = single_path
        else:
            raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
        self._handles: dict[str, Any] = {}
        self._stored: dict[str, str] = {}  # a name as asked for -> as stored (default: same)
        # A multimodal checkpoint may nest its language model (`model.language_model.layers...`,
        # Qwen3-VL and Qwen3.5 as published): its tensors go by the text model's names,
        # `model.layers...`.
        for k in list(self._file_of):
            prefix = next((p for p in _NESTED if k.startswith(p)), None)
            if prefix is None:
                continue
            name = _NESTED[prefix] + k[len(prefix):]
            self._stored[name] = k
            self._file_of[name] = self._file_of.pop(k)

    def language_model_only(self) -> list[str]:
        """A multimodal folder served as its language model: only the nested language
        model's tensors (already under the causal LM's names) and the LM head are kept;
        everything else (a vision tower, an MTP head) is left out. Returns the names left
        out."""
        kept = {name: path for name, path in self._file_of.items()
                if name in self._stored or name.startswith("lm_head.")}
        left = [name for name in self._file_of if name not in kept]
        self._file_of = kept
        return left

    def _handle(self, path: str) -> Any:
        h = self._handles.get(path)
        if h is None:
            if not os.path.exists(path):
                raise ValueError(f"checkpoint shard missing: {path}")
            h = safe_open(path, framework="pt", device=_device_str(self.device))
            self._handles[path] = h
        return h

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F8_E4M3", "I32", ...)."""
        return str(self._slice(name).get_dtype())

    def _slice(self, name: str) -> Any:
        return self._handle(self._file_of[name]).get_slice(self._stored.get(name, name))

    def get(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """The whole tensor, cast to `dtype` (None: as stored)."""
        if name not in self._file_of:
            raise ValueError(f"missing weight {name!r} in {self.model_dir}")
        t: torch.Tensor = self._handle(self._file_of[name]).get_tensor(
            self._stored.get(name, name))
        return t if dtype is None else t.to(dtype=dtype)

    def get_part(self, name: str, dtype: torch.dtype | None, dim: int | None, start: int = 0,
                 stop: int = 0) -> torch.Tensor:
        """[start, stop) along `dim` of a tensor (all of it when `dim` is None), reading only
        that part from the file: a tensor-parallel rank never loads the whole tensor. `dtype`
        None keeps the stored dtype (quantized tensors)."""
        if dim is None:
            return self.get(name, dtype)
        if name not in self._file_of:
            raise ValueError(f"missing weight {name!r} in {self.model_dir}")
        view = self._slice(name)
        t: torch.Tensor = view[start:stop] if dim == 0 else view[:, start:stop]
        return (t if dtype is None else t.to(dtype=dtype)).contiguous()

    def close(self) -> None:
        for h in self._handles.values():
            exit_ = getattr(h, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._handles.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
