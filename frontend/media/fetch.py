"""Images a request names by URL, fetched and decoded: `data:` URLs (base64), `http(s)://`
(fetched by the server) and `file://` under `--allowed-local-media-path`, as vLLM takes them.

Every failure is a `ValidationError` naming the request's field (HTTP 400 in OpenAI's shape):
corrupt base64, bytes that are not a PNG, JPEG, WebP or GIF image (a GIF reads as its
first frame), a scheme we do not fetch, a local path outside the allowed folder (or without
the flag), a fetch that fails, times out,
redirects to another scheme or sends more than `max_bytes`, an image with more pixels than
`max_pixels` (checked from its header, before decoding). Decoding runs on a worker thread:
the event loop keeps streaming.

Fetching uses aiohttp (an asyncio client, so a slow host holds no thread and the timeout is
the loop's), redirects followed by hand so none can leave http(s). Decoding uses Pillow, the
library transformers' image processors take images from.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tandem_serve.frontend.validation import ValidationError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how large they may be."""

    allowed_local_path: str = ""  # file:// only under this folder ("": never)
    max_images: int = 8  # per prompt (--limit-mm-per-prompt)
    max_bytes: int = 20 << 20  # an encoded image, fetched or inline
    max_pixels: int = 40_000_000  # width x height, decoded
    fetch_timeout: float = 10.0  # seconds for a whole http(s) fetch


async def load_image(url: str, field: str, policy: MediaPolicy) -> Any:
    """The image at `url` as an RGB PIL image; ValidationError(field, why) when it cannot."""
    if not isinstance(url, str) or not url:
        raise ValidationError(field, "must be a non-empty URL string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":  # base64 of megabytes: off the event loop, with the decoding
        return await asyncio.to_thread(
            lambda: decode_image(_data_url(url, field, policy), field, policy))
    if scheme in ("http", "https"):
        data = await _fetch(url, field, policy)
    elif scheme == "file":
        data = await asyncio.to_thread(_local, url, field, policy)
    else:
        raise ValidationError(field, f"unsupported URL scheme {scheme or url[:20]!r}; use "
                                     "data:, http(s):// or file:// (with "
                                     "--allowed-local-media-path)")
    return await asyncio.to_thread(decode_image, data, field, policy)


def _data_url(url: str, field: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValidationError(field, "a data: URL must be data:<media type>;base64,<data>")
    if not head.startswith("image/"):
        raise ValidationError(field, f"data: URL media type {head[:-7] or 'none'!r} is not "
                                     "an image type")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ValidationError(field, f"image data exceeds {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(field, "data: URL is not valid base64") from None


async def _fetch(url: str, field: str, policy: MediaPolicy) -> bytes:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=policy.fetch_timeout)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(MAX_REDIRECTS + 1):
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308):
                        url = urllib.parse.urljoin(url, resp.headers.get("Location", ""))
                        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                            raise ValidationError(field, "image URL redirects to a scheme "
                                                         "other than http(s)")
                        continue
                    if resp.status != 200:
                        raise ValidationError(field, f"fetching the image gave HTTP "
                                                     f"{resp.status}")
                    data = await resp.content.read(policy.max_bytes + 1)
                    if len(data) > policy.max_bytes:
                        raise ValidationError(field, f"image exceeds {policy.max_bytes} bytes")
                    return data
            raise ValidationError(field, f"image URL redirects more than {MAX_REDIRECTS} times")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        why = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc)
        raise ValidationError(field, f"fetching the image failed: {why}") from None


def _local(url: str, field: str, policy: MediaPolicy) -> bytes:
    if not policy.allowed_local_path:
        raise ValidationError(field, "file:// URLs need --allowed-local-media-path on the "
                                     "server")
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    real = os.path.realpath(path)
    root = os.path.realpath(policy.allowed_local_path)
    if os.path.commonpath([real, root]) != root:
        raise ValidationError(field, "file:// path is outside --allowed-local-media-path")
    try:
        with open(real, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as exc:
        raise ValidationError(field, f"cannot read the file: {exc.strerror}") from None
    if len(data) > policy.max_bytes:
        raise ValidationError(field, f"image exceeds {policy.max_bytes} bytes")
    return data


def decode_image(data: bytes, field: str, policy: MediaPolicy) -> Any:
    """Encoded bytes -> an RGB PIL image (blocking)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise ValidationError(field, "the data is not an image (PNG, JPEG, WebP or "
                                     "GIF)") from None
    if image.format not in FORMATS:
        raise ValidationError(field, f"image format {image.format} is not supported; use "
                                     "PNG, JPEG, WebP or GIF")
    width, height = image.size
    if width * height > policy.max_pixels:
        raise ValidationError(field, f"image is {width}x{height} pixels, more than "
                                     f"{policy.max_pixels}")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValidationError(field, f"the image does not decode: {exc}") from None
    return image.convert("RGB")
