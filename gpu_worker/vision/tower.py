"""The vision tower and projector of a VL checkpoint, and the embeddings it made, by image.

The tower is transformers' own module for the family (Qwen2.5-VL's
`Qwen2_5_VisionTransformerPretrainedModel`: patch embedding, windowed and full-attention
blocks with 2D RoPE, the 2x2 patch merger that projects into the language model's width;
Qwen3-VL's `Qwen3VLVisionModel`, which also returns DeepStack features from intermediate
blocks, and Qwen3-VL-MoE's `Qwen3VLMoeVisionModel`, the same; Qwen3.5's (dense and MoE)
`Qwen3_5VisionModel`, Qwen3-VL's without DeepStack; Gemma 3's
`SiglipVisionModel` and `Gemma3MultiModalProjector`, which average-pools the patch grid
to `mm_tokens_per_image` tokens), built from the checkpoint's `vision_config` and filled
from its `visual.*` (Gemma 3: `vision_tower.*`, `multi_modal_projector.*`) tensors: the
vision side runs once per image, during prefill, so its speed matters far less than
being the reference's arithmetic; writing it again would buy nothing but a second place
for bugs. The language model underneath stays Tandem's decoder.

One call encodes every image a forward needs and has not cached (Qwen's tower takes many
images as one packed sequence with per-image attention), and the results are kept by content
digest in an LRU bounded in bytes: a preempted request that prefills again, or the same image
in another request, is not encoded twice.
"""
from __future__ import annotations

import importlib
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open

from tandem_serve.proto.request_params import ImageInput
from tandem_serve.proto.vision import (
    GEMMA3_VL,
    QWEN2_5_VL,
    QWEN3_5_MOE_VL,
    QWEN3_5_VL,
    QWEN3_VL,
    QWEN3_VL_MOE,
    TOWER_PREFIXES,
    VisionSpec,
)

log = logging.getLogger(__name__)

# transformers' tower module of each Qwen family: (module under transformers.models, class).
_QWEN_TOWERS = {
    QWEN2_5_VL: ("qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    QWEN3_VL: ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
    QWEN3_VL_MOE: ("qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
    QWEN3_5_VL: ("qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"),
    QWEN3_5_MOE_VL: ("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionModel"),
}

# Embeddings kept for reuse: an image of the 7B model at 1,280 tokens is 9 MiB in bfloat16.
CACHE_BYTES = 512 << 20


class Gemma3Tower(torch.nn.Module):
    """Gemma 3's image encoder as transformers runs it (`Gemma3Model.get_image_features`):
    SigLIP's last hidden state through the pooling projector, [images * tokens, hidden]."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = SiglipVisionModel._from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(config).to(dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        from types import SimpleNamespace

        hidden = self.vision_tower(pixel_values=pixel_values).last_hidden_state
        out = self.multi_modal_projector(hidden)
        return SimpleNamespace(pooler_output=out.reshape(-1, out.shape[-1]))


class VisionTower:
    """Encodes images into language-model embeddings [tokens, hidden] (model dtype)."""

    def __init__(self, model_dir: str, spec: VisionSpec, dtype: torch.dtype,
                 device: torch.device, cache_bytes: int = CACHE_BYTES) -> None:
        import transformers

        full = transformers.AutoConfig.from_pretrained(model_dir)
        config = full.vision_config
        if spec.architecture == GEMMA3_VL:
            model: Any = Gemma3Tower(full, dtype)
        elif spec.architecture in _QWEN_TOWERS:
            module, name = _QWEN_TOWERS[spec.architecture]
            tower = getattr(importlib.import_module(f"transformers.models.{module}"), name)
            model = tower._from_config(config, dtype=dtype)
        else:
            raise ValueError(f"no vision tower for {spec.architecture}")
        model.load_state_dict(_visual_weights(model_dir), strict=True)
        self.model = model.to(device).eval()
        self.spec, self.dtype, self.device = spec, dtype, device
        self.merge = spec.spatial_merge_size ** 2
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cache_bytes, self._held = cache_bytes, 0
        self.encoded = 0  # images the tower ran on (tests: a cache hit encodes none)

    @torch.inference_mode()
    def embeddings(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings [1 + deepstack, tokens, hidden]: what replaces its
        placeholders, then (Qwen3-VL) what each DeepStack layer adds; encoding (in one call)
        those not cached."""
        todo = list({im.digest: im for im in images if im.digest not in self.cache}.values())
        if todo:
            pixels = torch.cat([torch.as_tensor(im.pixel_values) for im in todo])
            grid = torch.tensor([list(im.grid_thw) for im in todo], dtype=torch.int64)
            out = self.model(pixels.to(self.device, self.dtype), grid_thw=grid.to(self.device))
            levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
            sizes = [int(g.prod()) // self.merge for g in grid]
            for im, emb in zip(todo, torch.split(torch.stack(levels), sizes, dim=1),
                               strict=True):
                if emb.shape[1] != im.length:
                    raise ValueError(f"image at {im.offset}: the tower made {emb.shape[1]} "
                                     f"embeddings for {im.length} placeholder tokens")
                self._keep(im.digest, emb)
            self.encoded += len(todo)
        out_list = []
        for im in images:
            self.cache.move_to_end(im.digest)
            out_list.append(self.cache[im.digest])
        return out_list

    def _keep(self, digest: bytes, emb: torch.Tensor) -> None:
        self.cache[digest] = emb
        self._held += emb.nbytes
        # The newest entry stays even alone over the bound: this forward needs it.
        while self._held > self.cache_bytes and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self._held -= old.nbytes


def _visual_weights(model_dir: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    for name in files:
        with safe_open(os.path.join(model_dir, name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                prefix = next((p for p in TOWER_PREFIXES if key.startswith(p)), None)
                if prefix is not None:
                    out[TOWER_PREFIXES[prefix] + key[len(prefix):]] = f.get_tensor(key)
    if not out:
        raise ValueError(f"no vision tower weights (visual.*, vision_tower.*) in {model_dir}")
    return out
