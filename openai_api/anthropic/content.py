"""A user turn's blocks (and a `tool_result`'s) as chat message content.

Text blocks alone join into one string, as chat joins text parts. An `image` block becomes
chat's `image_url` part, so the one image path (`chat.content.parse_content`,
`frontend/media/`) fetches, decodes, counts and checks it: a `base64` source is a `data:`
URL of its media type, a `url` source the URL itself. Each image remembers the Messages
field it came from (`messages[0].content[1].source.data`), so an error the image path finds
under the chat field (`messages[2].content[0].image_url`) is reported under it.
"""
from __future__ import annotations

from typing import Any

from tandem_serve.frontend.validation import ValidationError

# The media types Anthropic's API takes for a base64 image.
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def image_part(block: dict[str, Any], at: str) -> tuple[dict[str, Any], str]:
    """(the chat image_url part of an image block, the Messages field its URL errors name)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ValidationError(f"{at}.source", 'must be {"type": "base64", "media_type", '
                                              '"data"} or {"type": "url", "url"}')
    kind = source.get("type")
    if kind == "base64":
        media = source.get("media_type")
        if media not in MEDIA_TYPES:
            raise ValidationError(f"{at}.source.media_type", f"must be one of "
                                                             f"{', '.join(MEDIA_TYPES)}; got "
                                                             f"{media!r}")
        data = source.get("data")
        if not isinstance(data, str) or not data:
            raise ValidationError(f"{at}.source.data", "must be a non-empty base64 string")
        url, where = f"data:{media};base64,{data}", f"{at}.source.data"
    elif kind == "url":
        value, where = source.get("url"), f"{at}.source.url"
        if not isinstance(value, str) or not value:
            raise ValidationError(where, "must be a non-empty URL string")
        url = value
    else:
        raise ValidationError(f"{at}.source.type", f"must be 'base64' or 'url', got {kind!r}")
    return {"type": "image_url", "image_url": {"url": url}}, where


def is_content_block(block: Any) -> bool:
    """A block that is message content: text or an image."""
    kind = block.get("type") if isinstance(block, dict) else None
    return kind == "image" or (kind == "text" and isinstance(block.get("text"), str))


def chat_content(blocks: list[tuple[str, dict[str, Any]]]
                 ) -> tuple[str | list[dict[str, Any]], list[tuple[int, str]]]:
    """Text and image blocks (each with its field) as chat content, and for each image its
    part's index and the Messages field it came from."""
    parts: list[dict[str, Any]] = []
    images: list[tuple[int, str]] = []
    for at, block in blocks:
        if block["type"] == "image":
            part, where = image_part(block, at)
            images.append((len(parts), where))
            parts.append(part)
        else:
            parts.append({"type": "text", "text": block["text"]})
    if not images:
        return "\n".join(p["text"] for p in parts), []
    return parts, images
