"""A vision-language checkpoint (tiny Qwen2.5-VL written by transformers) served through the
OpenAI chat API: image_url parts by data:, http:// and file:// URLs, greedy output and
prompt_tokens equal to transformers' with the checkpoint's own processor, the prefix cache
keyed by image content, the Responses API's input_image, Anthropic's image blocks through the
official client, and every bad image a 400 naming its part while other requests run on.
A tiny Gemma 3 (bidirectional attention among an image's tokens) under a step budget
smaller than an image: HF's tokens, images scheduled whole, prefix hits kept off images.
A tiny Qwen3.5 (hybrid linear attention): HF's tokens, and a prefix hit past an image, which
resumes from a recurrent state checkpointed after it."""
from __future__ import annotations

import base64
import http.server
import json
import pathlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import pytest

from tandem_serve.harness.metrics_scrape import Scrape
from tests.e2e.server import Server, running
from tests.vl_utils import (
    VLReference,
    gemma3_checkpoint,
    image_message,
    png_bytes,
    vl_checkpoint,
)

N = 10
BLOCK = 16  # the server's --block-size (the default)
IMAGES = [png_bytes(0), png_bytes(1, (60, 40)), png_bytes(2, (200, 150), "JPEG"),
          png_bytes(3, (50, 50), "WEBP")]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(IMAGES[1])
    return root


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vl_checkpoint(tmp_path_factory.mktemp("vl"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def ref(model: str) -> VLReference:
    return VLReference(model)


@pytest.fixture(scope="module")
def server(model: str, media: pathlib.Path) -> Iterator[Server]:
    yield from running(model, "--allowed-local-media-path", str(media),
                       "--limit-mm-per-prompt", '{"image": 2}', "--num-kv-blocks", "256",
                       "--served-model-name", "m",
                       http=True)


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """A local http server: /img.png, /redirect (to file://), anything else 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(IMAGES[2])))
                self.end_headers()
                self.wfile.write(IMAGES[2])
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "file:///etc/passwd")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def data_url(image: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(image).decode()


def parts(text: str, *urls: str) -> list[dict[str, Any]]:
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
            {"type": "text", "text": text}]


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def chat(server: Server, content: Any) -> tuple[int, dict[str, Any]]:
    return post(server, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": N,
        "temperature": 0, "return_token_ids": True})


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def check_hf(ref: VLReference, answer: dict[str, Any], text: str, images: list[bytes]) -> None:
    want, length = ref.greedy(image_message(text, len(images)) if images else
                              [{"role": "user", "content": text}], images, N)
    assert tokens(answer) == want
    assert answer["usage"]["prompt_tokens"] == length


def prefix_hits(server: Server) -> float:
    return Scrape(f"http://127.0.0.1:{server.http_port}/metrics").total(
        "vllm:prefix_cache_hits_total")


def hits_since(server: Server, before: float, want: float) -> float:
    """Prefix-cache hit tokens counted since `before`, once they reach `want` or after 10 s
    (the counters reach /metrics with the scheduler's reports, every 0.2 s)."""
    deadline = time.monotonic() + 10
    while (hits := prefix_hits(server) - before) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return hits


def chats_at_once_equal_hf(server: Server, ref: VLReference,
                           jobs: list[tuple[str, list[bytes]]]) -> list[dict[str, Any]]:
    """The chats (text, images) sent at once; each answer is HF's greedy tokens."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: chat(server, parts(j[0], *map(data_url, j[1]))
                                               if j[1] else j[0]), jobs))
    for (text, images), (status, answer) in zip(jobs, answers, strict=True):
        assert status == 200, answer
        check_hf(ref, answer, text, images)
    return [answer for _, answer in answers]


def test_images_and_text_chats_at_once_equal_hf(server: Server, ref: VLReference) -> None:
    jobs = [("what is this", [IMAGES[0]]), ("compare them", [IMAGES[0], IMAGES[1]]),
            ("hello there", []), ("and this one", [IMAGES[3]])]
    chats_at_once_equal_hf(server, ref, jobs)


def test_same_image_hits_the_prefix_cache_and_another_image_does_not_share_it(
        server: Server, ref: VLReference) -> None:
    text = "describe the picture in detail " * 4
    first = chat(server, parts(text, data_url(IMAGES[2])))[1]
    before = prefix_hits(server)
    again = chat(server, parts(text, data_url(IMAGES[2])))[1]
    assert tokens(again) == tokens(first)
    # At least every whole block up to the image's last placeholder (blocks holding the image
    # hash its content).
    ids = ref.inputs(image_message(text), [IMAGES[2]])["input_ids"][0].tolist()
    image_end = max(i for i, t in enumerate(ids) if t == ref.image_token_id) + 1
    want = image_end // BLOCK * BLOCK
    assert want > 16, want  # more than the system prompt's block
    assert hits_since(server, before, want) >= want
    other = chat(server, parts(text, data_url(IMAGES[1])))[1]
    check_hf(ref, other, text, [IMAGES[1]])
    check_hf(ref, first, text, [IMAGES[2]])


def test_http_and_file_urls(server: Server, ref: VLReference, site: str,
                            media: pathlib.Path) -> None:
    status, answer = chat(server, parts("what is this", f"{site}/img.png"))
    assert status == 200, answer
    check_hf(ref, answer, "what is this", [IMAGES[2]])
    status, answer = chat(server, parts("what is this", f"file://{media}/a.png"))
    assert status == 200, answer
    check_hf(ref, answer, "what is this", [IMAGES[1]])


def test_responses_input_image(server: Server, ref: VLReference) -> None:
    status, answer = post(server, "/v1/responses", {
        "model": "m", "max_output_tokens": N, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(IMAGES[0])},
            {"type": "input_text", "text": "what is this"}]}]})
    assert status == 200, answer
    assert answer["usage"]["input_tokens"] == ref.greedy(
        image_message("what is this"), [IMAGES[0]], 1)[1]


def _huge_png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (8000, 6000)).save(out, format="PNG")  # 48 megapixels, a small file
    return out.getvalue()


def test_bad_images_are_400_naming_the_part(server: Server, ref: VLReference, site: str,
                                            tmp_path: pathlib.Path) -> None:
    (tmp_path / "b.png").write_bytes(IMAGES[0])
    ok = data_url(IMAGES[0])
    cases = [
        ("data:image/png;base64,iVBOR%%%", 0, "not valid base64"),
        (data_url(b"just some text", "text/plain"), 0, "not an image type"),
        (data_url(b"just some text"), 0, "not an image"),
        ("ftp://example.com/a.png", 0, "unsupported URL scheme"),
        (f"file://{tmp_path}/b.png", 0, "outside --allowed-local-media-path"),
        (f"{site}/missing.png", 0, "HTTP 404"),
        (f"{site}/redirect", 0, "other than http(s)"),
        (data_url(_huge_png()), 0, "pixels"),
    ]
    in_flight = ThreadPoolExecutor(1).submit(chat, server, parts("keep going", ok))
    for url, index, why in cases:
        status, answer = chat(server, parts("x", url))
        assert status == 400, (url[:40], answer)
        error = answer["error"]
        assert error["param"] == f"messages[0].content[{index}].image_url", error
        assert why in error["message"], error
    status, answer = chat(server, parts("three", ok, ok, ok))
    assert status == 400 and answer["error"]["param"] == "messages[0].content[2].image_url"
    assert "--limit-mm-per-prompt" in answer["error"]["message"]
    status, answer = in_flight.result(timeout=120)
    assert status == 200
    check_hf(ref, answer, "keep going", [IMAGES[0]])


def test_guided_choice_with_an_image(server: Server) -> None:
    status, answer = post(server, "/v1/chat/completions", {
        "model": "m", "max_tokens": 20, "temperature": 0, "guided_choice": ["cat", "dog"],
        "messages": [{"role": "user", "content": parts("cat or dog?", data_url(IMAGES[0]))}]})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] in ("cat", "dog")


def test_anthropic_image_block_equals_chat(server: Server) -> None:
    """The official client's base64 image block: chat's text and prompt tokens, which
    count_tokens also counts; a bad block is Anthropic's 400 naming its source field."""
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.http_port}",
                                 api_key="none", max_retries=0, timeout=120)
    block: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(IMAGES[1]).decode()}}
    content: Any = [block, {"type": "text", "text": "what is this"}]
    # Greedy as chat: this client's create() has no temperature argument any more.
    made = client.messages.create(model="m", max_tokens=N, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": content}])
    status, answer = chat(server, parts("what is this", data_url(IMAGES[1])))
    assert status == 200, answer
    assert made.content[0].text == answer["choices"][0]["message"]["content"]  # type: ignore
    assert made.usage.input_tokens == answer["usage"]["prompt_tokens"]
    with client.messages.stream(model="m", max_tokens=N, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": content}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == made.content[0].text  # type: ignore[union-attr]
    assert streamed.usage.input_tokens == made.usage.input_tokens
    counted = client.messages.count_tokens(model="m",
                                           messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == made.usage.input_tokens
    call: Any = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "look",
                                                   "input": {}}]}
    in_result = [{"role": "user", "content": "look"}, call, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": content}]}]
    with_image = client.messages.count_tokens(model="m", messages=in_result).input_tokens
    in_result[2]["content"][0]["content"] = content[1:]
    without = client.messages.count_tokens(model="m", messages=in_result).input_tokens
    assert with_image - without == made.usage.input_tokens - client.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": content[1:]}]).input_tokens
    bad: Any = {"type": "image", "source": {**block["source"], "data": "iVBOR%%%"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=N, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, bad]}])
    assert exc.value.body["error"]["message"].startswith(  # type: ignore[index]
        "messages[0].content[1].source.data: data: URL is not valid base64")
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.count_tokens(model="m", messages=[
            {"role": "user", "content": [block, block, block]}])
    assert "messages[0].content[2].source.data" in str(exc.value)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, VLReference]]:
    path = gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))
    # 16-token images under a budget of 6 tokens a step: each is scheduled whole anyway.
    for server in running(path, "--max-num-batched-tokens", "6", "--num-kv-blocks", "128",
                          "--served-model-name", "m", http=True):
        yield server, VLReference(path)


def test_gemma3_chats_equal_hf_with_each_image_in_one_piece(
        gemma: tuple[Server, VLReference]) -> None:
    server, ref = gemma
    jobs = [("what is this", [IMAGES[0]]), ("compare them", [IMAGES[0], IMAGES[1]]),
            ("hello there", []), ("and this one", [IMAGES[2]])]
    answers = chats_at_once_equal_hf(server, ref, jobs)
    before = prefix_hits(server)
    status, again = chat(server, parts("what is this", data_url(IMAGES[0])))
    assert status == 200 and tokens(again) == tokens(answers[0])
    assert hits_since(server, before, 32) >= 32  # past the image
    # The same image, other text: the cached blocks end inside the image, so the hit ends
    # before it; another image behind the same text shares nothing of it.
    for text, image in (("tell me more", IMAGES[0]), ("what is this", IMAGES[3])):
        status, answer = chat(server, parts(text, data_url(image)))
        assert status == 200, answer
        check_hf(ref, answer, text, [image])


def test_qwen3_5_chats_equal_hf_and_a_hit_resumes_past_the_image(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3.5's linear layers keep a state per request, checkpointed every 64 tokens under
    prefix caching: a hit ends on a checkpoint, here past the image, so the state there
    holds the image. Another image behind the same text shares nothing after the system
    prompt, which ends before the first checkpoint."""
    path = vl_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")
    ref = VLReference(path)
    text = "describe the picture in detail " * 8
    for server in running(path, "--num-kv-blocks", "128", "--served-model-name", "m",
                          http=True):
        answers = chats_at_once_equal_hf(server, ref, [(text, [IMAGES[2]]), ("hello there", []),
                                                       ("compare them", IMAGES[:2])])
        before = prefix_hits(server)
        status, again = chat(server, parts(text, data_url(IMAGES[2])))
        assert status == 200 and tokens(again) == tokens(answers[0])
        hits = hits_since(server, before, 64)
        assert hits >= 64 and hits % 64 == 0, hits
        ids = ref.inputs(image_message(text), [IMAGES[2]])["input_ids"][0].tolist()
        assert max(i for i, t in enumerate(ids) if t == ref.image_token_id) < hits
        status, other = chat(server, parts(text, data_url(IMAGES[1])))
        assert status == 200, other
        check_hf(ref, other, text, [IMAGES[1]])
