"""Anthropic image blocks translated into chat image parts: where they land in the chat
request, and every refusal (ours, and the image path's fetch/decode/limit checks run on the
translated request) named by its Messages field."""
from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import pytest

from tandem_serve.frontend.media.fetch import MediaPolicy
from tandem_serve.frontend.media.images import ImageRef, Images
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.anthropic.protocol import (
    CountTokensRequest,
    Translation,
    chat_request,
    renamed,
)
from tandem_serve.openai_api.chat.content import parse_content
from tandem_serve.openai_api.errors import ApiError


def _image(fmt: str = "PNG") -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(out, format=fmt)
    return base64.b64encode(out.getvalue()).decode()


PNG = _image()


def b64(data: str = PNG, media: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}


def url(value: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "url", "url": value}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def translate(*messages: dict[str, Any], system: str | None = None) -> Translation:
    return chat_request(CountTokensRequest.model_validate({"messages": list(messages),
                                                           "system": system}))


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def result(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "t1", "content": list(blocks)}


CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                          "input": {}}]}


def test_image_blocks_become_image_url_parts_in_order() -> None:
    t = translate(user(text("before"), b64(), url("https://example.com/a.png"), text("after")),
                  system="be brief")
    chat = [m.model_dump(exclude_none=True) for m in t.chat.messages]
    assert chat[1]["content"] == [
        {"type": "text", "text": "before"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "text", "text": "after"}]
    assert t.images == {"messages[1].content[1].image_url": "messages[0].content[1].source.data",
                        "messages[1].content[2].image_url": "messages[0].content[2].source.url"}


def test_text_only_turns_stay_strings() -> None:
    t = translate(user(text("a"), text("b")))
    assert t.chat.messages[0].content == "a\nb" and t.images == {}


def test_images_in_a_tool_result_and_around_it() -> None:
    t = translate(user(text("look")), CALL,
                  user(b64(), result(text("seen:"), b64(_image("GIF"), "image/gif")),
                       text("and?")))
    chat = [m.model_dump(exclude_none=True) for m in t.chat.messages]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "tool", "user"]
    assert chat[2]["content"][0]["type"] == "image_url"
    assert chat[3]["tool_call_id"] == "t1" and chat[3]["content"][1]["image_url"]["url"] \
        .startswith("data:image/gif;base64,")
    assert chat[4]["content"] == "and?"
    assert t.images == {"messages[2].content[0].image_url": "messages[2].content[0].source.data",
                        "messages[3].content[1].image_url":
                            "messages[2].content[1].content[1].source.data"}


@pytest.mark.parametrize("block, field, why", [
    (b64(media="image/bmp"), "messages[0].content[1].source.media_type", "image/bmp"),
    (b64(data=""), "messages[0].content[1].source.data", "non-empty base64"),
    (url(""), "messages[0].content[1].source.url", "non-empty URL"),
    ({"type": "image"}, "messages[0].content[1].source", "base64"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}},
     "messages[0].content[1].source.type", "'file'"),
    ({"type": "document", "source": {}}, "messages[0].content[1]", "document blocks"),
])
def test_malformed_blocks_are_refused_naming_the_field(block: dict[str, Any], field: str,
                                                       why: str) -> None:
    with pytest.raises(ValidationError) as exc:
        translate(user(text("x"), block))
    assert exc.value.field == field and why in str(exc.value)


def test_images_stay_out_of_system_and_assistant_turns() -> None:
    with pytest.raises(ValidationError) as exc:
        chat_request(CountTokensRequest.model_validate(
            {"messages": [user(text("x"))], "system": [b64()]}))
    assert exc.value.field == "system[0]"
    with pytest.raises(ValidationError) as exc:
        translate(user(text("x")), {"role": "assistant", "content": [b64()]})
    assert exc.value.field == "messages[1].content[0]"


class _Processor:
    """Stands for a VL checkpoint's preprocessing: these cases fail before it runs."""

    def process(self, images: list[Any]) -> list[Any]:
        return [object() for _ in images]


def _image_error(t: Translation, limit: int = 2) -> ApiError:
    """The error the chat path's image checks raise on the translated request, renamed."""
    refs: list[ImageRef] = []
    for i, m in enumerate(t.chat.messages):
        refs += parse_content(m.content, f"messages[{i}].content")[1]
    images = Images(MediaPolicy(max_images=limit), _Processor())  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as exc:
        asyncio.run(images.prepare(refs))
    return renamed(ApiError.bad_parameter(exc.value), t.origins, t.images)


@pytest.mark.parametrize("block, field, why", [
    (b64("iVBOR%%%"), "messages[2].content[1].source.data", "not valid base64"),
    (b64(base64.b64encode(b"plain text").decode()), "messages[2].content[1].source.data",
     "not an image"),
    (b64(_image("BMP"), "image/png"), "messages[2].content[1].source.data", "format BMP"),
    (url("ftp://example.com/a.png"), "messages[2].content[1].source.url",
     "unsupported URL scheme"),
    (url("file:///etc/hostname"), "messages[2].content[1].source.url",
     "--allowed-local-media-path"),
])
def test_the_image_paths_refusals_name_the_messages_field(block: dict[str, Any], field: str,
                                                          why: str) -> None:
    # The system prompt shifts the chat message's index: 3 there, 2 here.
    t = translate(user(text("hi")), CALL, user(text("x"), block), system="s")
    error = _image_error(t)
    assert error.param == field and error.message.startswith(field + ":"), error.message
    assert why in error.message


def test_too_many_images_names_the_first_over_the_limit() -> None:
    t = translate(user(b64()), CALL, user(result(b64()), b64()))
    error = _image_error(t)
    assert error.param == "messages[2].content[1].source.data"
    assert "at most 2 images" in error.message
