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

    # Gemma 3: the text's `<start_of_image>` becomes the processor's whole image sequence
    # before tokenizing (`expand_text`), as Gemma3Processor does ("": other families).
    placeholder = sequence = ""

    def __init__(self, model_dir: str, spec: VisionSpec) -> None:
        self.spec = spec
        if spec.bidirectional:
            self.processor: Any = _gemma3_processor(self, model_dir)
            return
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_dir)

    def process(self, images: list[Any]) -> list[Processed]:
        """PIL images -> what the tower reads, one entry per image (blocking: a thread's)."""
        if not images:
            return []
        if self.sequence:
            return self._process_whole(images)
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

    def _process_whole(self, images: list[Any]) -> list[Processed]:
        """Gemma 3: each image resized whole to the tower's square, `tokens_per_image`
        tokens."""
        out = self.processor(images=images, return_tensors="np")
        if any(int(n) for n in np.asarray(out.get("num_crops", [0])).ravel()):
            raise ImageError("pan-and-scan crops are not supported")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        tokens = self.spec.tokens_per_image
        side = int(tokens ** 0.5)
        result = []
        for i in range(pixels.shape[0]):
            part = np.ascontiguousarray(pixels[i:i + 1])
            digest = hashlib.blake2b(part.tobytes(), digest_size=16).digest()
            result.append(Processed(part, [1, side, side], tokens, digest))
        return result

    def expand_text(self, text: str, count: int) -> str:
        """The rendered prompt before tokenizing: Gemma 3's `<start_of_image>` replaced by
        the processor's image sequence ("\n\n<start_of_image>", the image tokens,
        "<end_of_image>\n\n"), so the text around it tokenizes as in transformers; other
        families expand after tokenizing (`expand`)."""
        if not self.sequence:
            return text
        found = text.count(self.placeholder)
        if found != count:
            raise ImageError(f"the prompt has {found} {self.placeholder} for {count} images")
        return text.replace(self.placeholder, self.sequence)

    def expand(self, ids: list[int], images: list[Processed]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's one placeholder (as the chat template writes it)
        repeated once per embedding, and the images' places in it."""
        token = self.spec.image_token_id
        if self.sequence:
            return ids, self._places(ids, images)
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

    def _places(self, ids: list[int], images: list[Processed]) -> list[ImageInput]:
        """Gemma 3: the images' places in a prompt already expanded (`expand_text`): one run
        of `tokens_per_image` image tokens each."""
        token = self.spec.image_token_id
        runs: list[list[int]] = []
        for i, t in enumerate(ids):
            if t != token:
                continue
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        lengths = [n for _, n in runs]
        if len(runs) != len(images) or any(n != self.spec.tokens_per_image for n in lengths):
            raise ImageError(f"the prompt's image tokens come in runs of {lengths}, not "
                             f"{len(images)} of {self.spec.tokens_per_image}")
        if runs and runs[-1][0] + runs[-1][1] == len(ids):
            raise ImageError("the prompt ends with an image; a text token must follow it")
        return [ImageInput(at, n, im.digest, im.pixel_values, im.grid_thw, bidirectional=True)
                for (at, n), im in zip(runs, images, strict=True)]


def _gemma3_processor(pre: ImagePreprocessor, model_dir: str) -> Any:
    """Gemma 3's image processor, and its placeholder and image sequence (set on `pre`),
    from the checkpoint's own Gemma3Processor; pan-and-scan is refused."""
    from transformers import AutoProcessor

    full = AutoProcessor.from_pretrained(model_dir)
    if getattr(full.image_processor, "do_pan_and_scan", False):
        raise ValueError(f"{model_dir}: the image processor enables pan-and-scan "
                         "(do_pan_and_scan), which is not supported: set it to false in "
                         "preprocessor_config.json (transformers' default)")
    if int(full.image_seq_length) != pre.spec.tokens_per_image:
        raise ValueError(f"{model_dir}: the processor's image_seq_length "
                         f"{full.image_seq_length} differs from config.json's "
                         f"mm_tokens_per_image {pre.spec.tokens_per_image}")
    pre.placeholder, pre.sequence = full.boi_token, full.full_image_sequence
    return full.image_processor


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
