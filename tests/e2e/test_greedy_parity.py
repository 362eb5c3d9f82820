"""End to end over real processes: greedy streams equal HF `generate()` on the same checkpoint."""
from __future__ import annotations

import pathlib
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    ("Once upon a time", 24),
    ("The quick brown fox jumps over", 9),
    ("Tandem runs the model while", 17),
    ("1, 2, 3, 4,", 31),
]
# Under Triton's interpreter every decode row's program runs in Python: fewer tokens, the
# first (last) prompt's still enough to be decoding when the others arrive.
SHORT = [(text, n) for (text, _), n in zip(PROMPTS, [6, 4, 5, 16], strict=True)]


@pytest.fixture(scope="module")
def hf_outputs(tiny_model_dir: pathlib.Path) -> dict[tuple[str, int], str]:
    jobs = list(dict.fromkeys(PROMPTS + SHORT))
    return dict(zip(jobs, hf_greedy(tiny_model_dir, jobs), strict=True))


def stream_text(server: Server, text: str, n: int) -> tuple[str, int]:
    parts = []
    last = None
    for resp in server.client.stream(text, GenerateOptions(max_new_tokens=n, min_new_tokens=n)):
        parts.append(resp.text)
        last = resp
    assert last is not None
    return "".join(parts), last.generated_token_count


@pytest.mark.parametrize("steps, mode", [(1, "--async-postproc"), (8, "--async-postproc"),
                                         (1, "--no-async-postproc"), (8, "--no-async-postproc")])
def test_concurrent_greedy_streams_equal_hf(tiny_model_dir: pathlib.Path,
                                            hf_outputs: dict[tuple[str, int], str], steps: int,
                                            mode: str) -> None:
    server = Server(str(tiny_model_dir), "--num-scheduler-steps", str(steps), mode).wait_ready()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: stream_text(server, *p), PROMPTS))
        for (text, n), (got, count) in zip(PROMPTS, results, strict=True):
            assert count == n
            assert got == hf_outputs[text, n], f"K={steps} {mode}: {text!r}"
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
def test_every_attention_backend_streams_the_default_tokens(
        tiny_model_dir: pathlib.Path, hf_outputs: dict[tuple[str, int], str],
        backend: str) -> None:
    """`--attention-backend NAME` reaches the gpu worker, and its streams equal HF's, as the
    default's do (the test above).  The later prompts arrive while the first decodes, so its
    steps carry their prefill: flex runs those mixed steps in one FlexAttention call (eagerly,
    on the CPU), sdpa in its split path, triton in its kernel (under Triton's interpreter
    without a GPU: TRITON_INTERPRET=1, tests/conftest.py)."""
    prompts = SHORT if backend == "triton" else PROMPTS
    server = Server(str(tiny_model_dir), "--attention-backend", backend,
                    "--max-num-batched-tokens", "8").wait_ready()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            first = pool.submit(stream_text, server, *prompts[-1])
            time.sleep(0.3)
            rest = list(pool.map(lambda p: stream_text(server, *p), prompts[:-1]))
        for (text, n), (got, count) in zip(prompts, [*rest, first.result()], strict=True):
            assert (got, count) == (hf_outputs[text, n], n), f"{backend}: {text!r}"
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


def test_bad_prompts_are_rejected_and_others_keep_going(tiny_model_dir: pathlib.Path,
                                                        hf_outputs: dict[tuple[str, int], str]
                                                        ) -> None:
    server = Server(str(tiny_model_dir), "--max-model-len", "64").wait_ready()
    try:
        with ThreadPoolExecutor(1) as pool:
            text, n = PROMPTS[0]
            valid = pool.submit(stream_text, server, text, n)
            for bad, limit in [("", "must not be empty"), ("word " * 80, "max model length 64")]:
                with pytest.raises(grpc.RpcError) as err:
                    list(server.client.stream(bad, GenerateOptions(max_new_tokens=4)))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert limit in err.value.details()
            assert valid.result()[0] == hf_outputs[text, n]
    finally:
        assert server.stop() == 0
