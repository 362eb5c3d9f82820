"""`PoolingRunner`: one forward over a batch of pooling requests, one vector (or a
cross-encoder's logits) per request.

The model is transformers' own (`AutoModel`, `AutoModelForSequenceClassification`), the
classes sentence-transformers runs, so BERT's token types and absolute positions, XLM-R's
positions counted from the padding id and Qwen3's RoPE are exactly as published.  Attention
is dense: each batch is padded to its longest row and attends with a padding mask (SDPA).
A pooling request is prefill only and keeps no KV, so a paged cache would be memory written
once and never read, and the paged kernels' bookkeeping a cost with nothing to save.

Pooling and the cut to `dimensions`, normalisation and the cross-encoder's activation are
not here: pooling is (it reduces the rows), the rest depends on the request and happens in
the frontend, so every request of a batch gets the same work from the device.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem_serve.gpu_worker.pooling.sharding import shard, split_problems
from tandem_serve.pooling.folder import PoolingSpec
from tandem_serve.proto.pooling_messages import PoolRequest

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.parallel import TensorParallel

log = logging.getLogger("tandem.gpu_worker")

CHUNK_ROWS = {"cpu": 32, "cuda": 256}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":  # float32 on the CPU (the oracle's precision), bfloat16 on a GPU
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


class PoolingRunner:
    """The model and its pooling, built once from the folder."""

    def __init__(self, model_dir: str, spec: PoolingSpec, device: torch.device,
                 dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per load in the server's log says nothing

        self.spec, self.device, self.dtype = spec, device, dtype
        cls = AutoModelForSequenceClassification if spec.kind == "classify" else AutoModel
        model = cls.from_pretrained(model_dir, dtype=dtype)
        if tp is not None and tp.size > 1:  # this rank's heads and MLP columns (sharding.py)
            problems = split_problems(model.config, tp.size)
            if problems:
                raise ValueError(f"cannot be split: {'; '.join(problems)}")
            split = shard(model, tp.rank, tp.size, spec.causal, tp.all_reduce)
            log.info("rank %d of %d keeps its part of %d linears", tp.rank, tp.size, split)
        self.model = model.to(device).eval()
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        # Rows per forward (`run`): small on a CPU, where a bigger batch buys little; on a
        # GPU wide enough to fill it.
        self.chunk_rows = CHUNK_ROWS.get(device.type, CHUNK_ROWS["cpu"])

    @torch.inference_mode()
    def run(self, requests: Sequence[PoolRequest]) -> np.ndarray:
        """(len(requests), dimensions) float32: pooled hidden states or logits, in order.

        The rows go through the model sorted by length, in chunks of `chunk_rows`, as
        sentence-transformers' encode() does: each chunk is padded to its own longest row,
        so a batch of mixed lengths costs about its tokens, not rows times its longest."""
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: np.ndarray | None = None
        for start in range(0, len(order), self.chunk_rows):
            part = order[start:start + self.chunk_rows]
            rows = self._forward([requests[i] for i in part])
            if out is None:
                out = np.empty((len(requests), rows.shape[1]), dtype=np.float32)
            out[part] = rows
        assert out is not None, "a plan has at least one request"
        return out

    def _forward(self, requests: Sequence[PoolRequest]) -> np.ndarray:
        ids, types, mask, lengths = self._pad(requests)
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if self.spec.uses_token_types:
            kwargs["token_type_ids"] = types
        out = self.model(**kwargs)
        if self.spec.kind == "classify":
            return out.logits.float().cpu().numpy()
        hidden = out.last_hidden_state
        return pool(hidden, mask, lengths, self.spec.pooling).float().cpu().numpy()

    def _pad(self, requests: Sequence[PoolRequest]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right padding: positions then count from 0 in every row, for encoders and
        decoders alike, and a causal row never sees its padding."""
        lengths = np.array([len(r.prompt_ids) for r in requests], dtype=np.int64)
        width = int(lengths.max())
        ids = np.full((len(requests), width), self.pad_id, dtype=np.int64)
        types = np.zeros((len(requests), width), dtype=np.int64)
        mask = np.zeros((len(requests), width), dtype=np.int64)
        for i, r in enumerate(requests):
            n = lengths[i]
            ids[i, :n] = r.prompt_ids
            if len(r.token_type_ids):
                types[i, :n] = r.token_type_ids
            mask[i, :n] = 1
        dev = self.device
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(types).to(dev),
                torch.from_numpy(mask).to(dev), torch.from_numpy(lengths).to(dev))


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor,
         mode: str) -> torch.Tensor:
    """sentence-transformers' Pooling: mean over the row's tokens, its first token, or its
    last (right padding: at length - 1)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
