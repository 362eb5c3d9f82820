"""Message content parts as chat templates read them, and the images they name.

OpenAI's content is a string or a list of parts. Text-only lists join into one string
(vLLM's "string" content format, which every template reads); a list with images keeps its
parts in order as `{"type": "text", "text": ...}` and `{"type": "image"}` (the form HF's VL
templates and processors take), and each image's URL is collected with the field that names
it, for errors. `image_part` is the one rule for an image part's URL, so other message
formats (Responses' `input_image`, Anthropic's image blocks) can reuse it.
"""
from __future__ import annotations

from typing import Any

from tandem_serve.frontend.media.images import ImageRef
from tandem_serve.frontend.validation import ValidationError

TEXT_KINDS = ("text", "input_text", "output_text")
IMAGE_KINDS = ("image_url", "input_image")


def image_part(part: dict[str, Any], field: str) -> ImageRef:
    """An image part's URL: OpenAI chat's {"type": "image_url", "image_url": {"url": ...}}
    (or the URL as a plain string), Responses' {"type": "input_image", "image_url": ...}."""
    value = part.get("image_url")
    where = f"{field}.image_url"
    if isinstance(value, dict):
        value = value.get("url")
        where += ".url" if not isinstance(value, str) else ""
    if not isinstance(value, str) or not value:
        raise ValidationError(where, "must be an image URL (data:, http(s):// or file://)")
    return ImageRef(value, f"{field}.image_url")


def parse_content(content: Any, field: str, kinds: tuple[str, ...] = TEXT_KINDS
                  ) -> tuple[Any, list[ImageRef]]:
    """(the content as the template reads it, the images it names in order)."""
    if not isinstance(content, list):
        return content, []
    parts: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_KINDS:
            images.append(image_part(part, where))
            parts.append({"type": "image"})
        elif kind in kinds and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ValidationError(where, f"only text and image_url parts are supported, got "
                                         f"type {kind!r}")
    if not images:
        return "\n".join(p["text"] for p in parts), []
    return parts, images
