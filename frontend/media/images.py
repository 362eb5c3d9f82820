"""A VL checkpoint's image preprocessing, on the frontend: the checkpoint's own Hugging Face
image processor (resize, patching, normalisation, as its preprocessor_config.json says), then
the prompt's placeholder expanded to one token per embedding the vision tower will make.

Why the frontend and not the gpu worker: preprocessing is CPU work per request (decode,
resize, normalise) that would otherwise sit between the worker's steps; here it runs on a
worker thread, beside the streams the event loop serves, and the worker receives ready
pixel tensors with the request (msgpack frames of the plan, no copy on the wire).  Why
transformers' processor: parity with the reference is the contract, and the processor is
the reference; it imports torch, so a frontend serving a VL model pays that import once at
start-up (a text-only model never loads it).
"""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem_serve.frontend.media.fetch import MediaPolicy, load_image
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.proto.request_params import ImageInput
from tandem_serve.proto.vision import VisionSpec, read_spec


class ImageError(ValueError):
    """An image the processor cannot take (too large, no pixels)."""


@dataclass
class Processed:
    """One image as the tower reads it."""

    pixel_values: np.ndarray  # float32 [patches, channels * patch volume]
    grid_thw: list[int]
    tokens: int  # placeholder tokens (embeddings) it takes in the prompt
    digest: bytes


class ImagePreprocessor:
    """The checkpoint's image processor and its placeholder token."""

    def __init__(self, model_dir: str, spec: VisionSpec) -> None:
        from transformers import AutoImageProcessor

        self.processor: Any = AutoImageProcessor.from_pretrained(model_dir)
        self.spec = spec

    def process(self, images: list[Any]) -> list[Processed]:
        """PIL images -> what the tower reads, one entry per image (blocking: a thread's)."""
        if not images:
            return []
        out = self.processor(images=images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = np.asarray(out["image_grid_thw"], dtype=np.int64)
        merge = self.spec.spatial_merge_size ** 2
        result, at = [], 0
        for grid in grids:
            n = int(grid.prod())
            part = np.ascontiguousarray(pixels[at:at + n])
            at += n
            digest = hashlib.blake2b(part.tobytes() + grid.tobytes(), digest_size=16).digest()
            result.append(Processed(part, [int(x) for x in grid], n // merge, digest))
        return result

    def expand(self, ids: list[int], images: list[Processed]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's one placeholder (as the chat template writes it)
        repeated once per embedding, and the images' places in it."""
        token = self.spec.image_token_id
        at = [i for i, t in enumerate(ids) if t == token]
        if len(at) != len(images):
            raise ImageError(f"the prompt has {len(at)} image placeholders for {len(images)} "
                             "images")
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for where, im in zip(at, images, strict=True):
            out += ids[prev:where]
            inputs.append(ImageInput(len(out), im.tokens, im.digest, im.pixel_values,
                                     im.grid_thw))
            out += [token] * im.tokens
            prev = where + 1
        out += ids[prev:]
        if out and out[-1] == token:
            raise ImageError("the prompt ends with an image; a text token must follow it")
        return out, inputs


@dataclass
class ImageRef:
    """An image a request names: its URL and the request field that holds it (errors name
    the field, e.g. `messages[0].content[1].image_url`)."""

    url: str
    field: str


class Images:
    """A server's image input: where images may come from, and (a VL model) how they are
    preprocessed; a text-only model refuses them."""

    def __init__(self, policy: MediaPolicy, preprocessor: ImagePreprocessor | None) -> None:
        self.policy = policy
        self.preprocessor = preprocessor

    @classmethod
    def for_model(cls, model_dir: str, policy: MediaPolicy) -> Images:
        spec = read_spec(model_dir)
        return cls(policy, ImagePreprocessor(model_dir, spec) if spec is not None else None)

    async def prepare(self, refs: Sequence[ImageRef]) -> list[Processed]:
        """Fetch, decode and preprocess a prompt's images (ValidationError naming the part)."""
        if not refs:
            return []
        if self.preprocessor is None:
            raise ValidationError(refs[0].field, "this model does not take images (a "
                                                 "text-only checkpoint)")
        limit = self.policy.max_images
        if len(refs) > limit:
            raise ValidationError(refs[limit].field, f"at most {limit} images per prompt "
                                                     "(--limit-mm-per-prompt)")
        pil = await asyncio.gather(*(load_image(r.url, r.field, self.policy) for r in refs))
        return await asyncio.to_thread(self._process, list(pil), refs)

    def _process(self, pil: list[Any], refs: Sequence[ImageRef]) -> list[Processed]:
        assert self.preprocessor is not None
        out = []
        for image, ref in zip(pil, refs, strict=True):
            try:  # one at a time: a refusal names its own part
                out += self.preprocessor.process([image])
            except ValueError as exc:
                raise ValidationError(ref.field, f"the image processor refused the image: "
                                                 f"{exc}") from None
        return out
