"""`tandem bench serve`'s HTTP backends against Tandem's own OpenAI-compatible API, on one
real server: every request completes with the asked length, and the figures exist."""
from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator

import pytest

from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.run import run_benchmark
from tests.e2e.server import Server, running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--served-model-name", "tiny-llama", http=True)


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_bench_serve_drives_the_http_api(server: Server, tiny_model_dir: pathlib.Path,
                                         backend: str) -> None:
    cfg = BenchConfig(backend=backend, base_url=f"http://127.0.0.1:{server.http_port}",
                      model=str(tiny_model_dir), num_prompts=4, input_len=16, output_len=8,
                      max_concurrency=2, progress=False)
    result = asyncio.run(run_benchmark(cfg))
    assert result["completed"] == 4 and result["total_output_tokens"] == 32
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
