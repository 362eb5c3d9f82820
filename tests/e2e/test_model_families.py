"""End to end over real processes: each new family (published config.json) serves greedy
streams, concurrently, whose text equals HF `generate()` on the same checkpoint."""
from __future__ import annotations

import pathlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server import Server
from tests.e2e.test_greedy_parity import stream_text
from tests.gpu_worker.family_utils import FAMILIES, family_checkpoint
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    ("Once upon a time", 24),
    ("the quick brown fox jumps over the lazy dog", 9),
    ("tandem runs the model while", 17),
]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_concurrent_greedy_streams_equal_hf(tmp_path_factory: pytest.TempPathFactory,
                                            family: str) -> None:
    root = tmp_path_factory.mktemp(f"e2e-{family}")
    model = family_checkpoint(root, family, published=True, tokenizer=True)
    want = hf_greedy(pathlib.Path(model), PROMPTS)
    server = Server(model, "--num-scheduler-steps", "8").wait_ready()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: stream_text(server, *p), PROMPTS))
        for (text, n), (got, count), expected in zip(PROMPTS, results, want, strict=True):
            assert count == n
            assert got == expected, f"{family}: {text!r}"
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []
