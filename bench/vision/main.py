"""`tandem bench vision`: a VL server's image chats against text-only chats of the same
prompt token count and output length, in requests per second, and the vision encoder's
share of the gpu worker's step time (`tandem profile`'s spans over an image run).

Every image request sends a different random image (no prefix-cache or embedding-cache
hits), so each pays its decode, preprocessing and encoding; the text chats repeat one word
until their prompt has the image chat's token count. Both run greedy with exactly
`--max-tokens` output tokens (`min_tokens`, `ignore_eos`).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tandem_serve.harness.server import serving
from tandem_serve.tandem import profile_report
from tandem_serve.tandem.profile_cli import record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a VL checkpoint folder")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--image-size", default="224x224", help="WIDTHxHEIGHT of each image")
    p.add_argument("--json", default="", help="write the figures here")


def _image(seed: int, size: tuple[int, int]) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class _Client:
    def __init__(self, port: int, max_tokens: int) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.max_tokens = max_tokens

    def chat(self, content: Any, max_tokens: int | None = None) -> dict[str, Any]:
        n = max_tokens or self.max_tokens
        body = {"model": "m", "messages": [{"role": "user", "content": content}],
                "max_tokens": n, "temperature": 0, "min_tokens": n, "ignore_eos": True}
        req = urllib.request.Request(self.url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return dict(json.load(r))

    def run(self, contents: list[Any], concurrency: int) -> float:
        """Requests per second over all of `contents`."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(self.chat, contents))
        return len(contents) / (time.perf_counter() - t0)


def _text_of(client: _Client, tokens: int) -> str:
    """A text chat whose prompt has `tokens` tokens (repeats one word; probed)."""
    lo, hi = 1, tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if client.chat(" ".join(["hello"] * mid), 1)["usage"]["prompt_tokens"] <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(["hello"] * lo)
    got = client.chat(text, 1)["usage"]["prompt_tokens"]
    for extra in ("!", " !", " ! !"):  # close a gap of a token or two
        if got == tokens:
            break
        more = client.chat(text + extra, 1)["usage"]["prompt_tokens"]
        if more == tokens:
            text, got = text + extra, more
    return text


def main(args: argparse.Namespace) -> int:
    w, h = (int(x) for x in args.image_size.split("x"))
    with serving(args.model, ["--served-model-name", "m"], http=True, quiet=True) as s:
        client = _Client(s.http_port, args.max_tokens)

        def images(first: int) -> list[Any]:
            return [[{"type": "image_url", "image_url": {"url": _image(first + i, (w, h))}},
                     {"type": "text", "text": "Describe the picture."}]
                    for i in range(args.requests)]

        tokens = client.chat(images(10**6)[0], 1)["usage"]["prompt_tokens"]
        text = _text_of(client, tokens)
        client.run(images(10**7)[: args.concurrency], args.concurrency)  # warm-up
        text_rps = client.run([text] * args.requests, args.concurrency)
        image_rps = client.run(images(0), args.concurrency)
        # The encoder's share: spans recorded while another image run goes on.
        profiles: list[Any] = []
        load = threading.Thread(target=client.run, args=(images(10**5), args.concurrency))
        load.start()
        time.sleep(0.5)
        profiles = record("127.0.0.1", s.port, 3.0).profiles
        load.join()
    summary = profile_report.summarize(profiles)
    worker = next(p for p in summary.processes if p.role == "gpu-worker")
    encode = worker.spans.get("encode")
    device_ms = summary.device_busy_pct / 100 * summary.window_ms
    share = (encode.total_ms / device_ms) if encode and device_ms else 0.0
    figures = {"prompt_tokens": tokens, "max_tokens": args.max_tokens,
               "requests": args.requests, "concurrency": args.concurrency,
               "image_size": args.image_size, "text_req_s": round(text_rps, 3),
               "image_req_s": round(image_rps, 3),
               "image_over_text": round(image_rps / text_rps, 3),
               "encoder_share_of_device_time": round(share, 3),
               "encode_mean_ms": round(encode.mean_ms, 3) if encode else 0.0}
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
