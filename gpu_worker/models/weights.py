"""Reading HF safetensors checkpoints (single file or sharded with an index), stacked experts
as per-expert views."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
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
_STACKED_GATE_UP = "mlp.experts.gate_up_proj"


@dataclass(frozen=True)
class _ExpertView:
    """One expert's gate, up or down weight inside a stacked tensor."""

    stacked: str  # the stacked tensor's name
    expert: int
    inter: int  # which of its dims is the intermediate one (1 or 2)
    first: int  # the weight's first row along it (up: I, after gate's)
    width: int  # I
    down: bool


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
        self._experts: dict[str, _ExpertView] = {}
        self._experts_stacked: dict[str, str] = {}  # stacked name -> its file
        self._unstack_experts()

    def _unstack_experts(self) -> None:
        """Stacked experts (`mlp.experts.gate_up_proj` and `down_proj`, 3-D: Qwen3-VL-MoE,
        published and as transformers 5 writes it) served as HF's per-expert names
        (`mlp.experts.{e}.gate_proj.weight`, ...), each a view read from the stacked tensor,
        so layout, sharding and the loader see one set of names whatever the file holds."""
        for gu in [k for k in self._file_of if k.endswith(_STACKED_GATE_UP)]:
            p = gu[: -len("gate_up_proj")]  # ...mlp.experts.
            dn = p + "down_proj"
            if dn not in self._file_of:
                raise ValueError(f"{gu} has no {dn} beside it in {self.model_dir}")
            (e, a, b), (_, c, d) = self.shape(gu), self.shape(dn)
            # transformers 5 writes the linear layout, gate|up [E, 2I, H] and down [E, H, I];
            # the published checkpoints hold the matmul layout, [E, H, 2I] and [E, I, H].
            # The pair tells them apart: the two tests below never both hold.
            if b == c and a == 2 * d:
                inter, i = 1, d
            elif a == d and b == 2 * c:
                inter, i = 2, c
            else:
                raise ValueError(f"stacked experts {gu} {[e, a, b]} and {dn} {[e, c, d]} are "
                                 "neither [E, 2I, H] with [E, H, I] nor [E, H, 2I] with "
                                 f"[E, I, H] ({self.model_dir})")
            for x in range(e):
                q = f"{p}{x}."
                for name, stacked, first, down in ((q + "gate_proj.weight", gu, 0, False),
                                                   (q + "up_proj.weight", gu, i, False),
                                                   (q + "down_proj.weight", dn, 0, True)):
                    # down's intermediate dim is the other one of gate|up's
                    self._experts[name] = _ExpertView(stacked, x, 3 - inter if down else inter,
                                                      first, i, down)
                    self._file_of[name] = self._file_of[stacked]
            for stacked in (gu, dn):
                self._experts_stacked[stacked] = self._file_of.pop(stacked)

    def language_model_only(self) -> list[str]:
        """A multimodal folder's language model: only the nested language model's tensors
        (already under the causal LM's names) and the LM head are kept; everything else (a
        vision tower, which `gpu_worker.vision.tower` reads itself, an MTP head) is left
        out. Returns the names left out."""
        nested = {v.stacked for v in self._experts.values()} & set(self._stored)
        kept = {name: path for name, path in self._file_of.items()
                if name in self._stored or name.startswith("lm_head.")
                or (name in self._experts and self._experts[name].stacked in nested)}
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
        view = self._experts.get(name)
        if view is not None:
            h = self._slice(view.stacked).get_shape()[3 - view.inter]
            return (h, view.width) if view.down else (view.width, h)
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F8_E4M3", "I32", ...)."""
        view = self._experts.get(name)
        return str(self._slice(view.stacked if view else name).get_dtype())

    def _slice(self, name: str) -> Any:
        path = self._file_of.get(name) or self._experts_stacked[name]
        return self._handle(path).get_slice(self._stored.get(name, name))

    def _expert(self, view: _ExpertView, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the expert's intermediate dimension, as a linear weight
        ([I, H] for gate and up, [H, I] for down)."""
        at: list[slice] = [slice(view.expert, view.expert + 1), slice(None), slice(None)]
        at[view.inter] = slice(view.first + start, view.first + stop)
        t: torch.Tensor = self._slice(view.stacked)[tuple(at)][0]
        # Stored [inter, H] (inter 1) or [H, inter] (inter 2); down's linear layout is the
        # other way round from gate's and up's.
        return t.t() if (view.inter == 2) != view.down else t

    def get(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """The whole tensor, cast to `dtype` (None: as stored)."""
        if name not in self._file_of:
            raise ValueError(f"missing weight {name!r} in {self.model_dir}")
        view = self._experts.get(name)
        if view is not None:
            t = self._expert(view, 0, view.width).contiguous()
            return t if dtype is None else t.to(dtype=dtype)
        t = self._handle(self._file_of[name]).get_tensor(
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
        expert = self._experts.get(name)
        if expert is not None:  # split along its intermediate dimension, whichever dim
            assert dim == (1 if expert.down else 0), (name, dim)
            t = self._expert(expert, start, stop)
            return (t if dtype is None else t.to(dtype=dtype)).contiguous()
        view = self._slice(name)
        t = view[start:stop] if dim == 0 else view[:, start:stop]
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
