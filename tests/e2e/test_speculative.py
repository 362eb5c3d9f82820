"""End to end: with `--speculative-config` greedy streams still equal HF `generate()`, K=8
async with n-gram drafts and K=1 sync with a draft model (the target itself: every draft is
its argmax), and the spec-decode counters move; on a model that copies (nearly a bigram
model) n-gram drafts from a copy-heavy prompt are accepted."""
from __future__ import annotations

import json
import pathlib
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server import Server, free_port
from tests.e2e.test_greedy_parity import stream_text
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

# Every eligible row speculates: whether the measured rule would depends on how busy the
# machine was when the worker timed its forwards (the rule has its own tests).
SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
        '"adaptive": false}')
PROMPTS = [
    ("one two three four five one two three four five one two three four five one two", 24),
    ("1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", 20),
    ("The quick brown fox jumps over", 9),
    ("abc abc abc abc abc abc abc abc abc", 30),
]


@pytest.fixture(scope="module")
def hf_outputs(tiny_model_dir: pathlib.Path) -> dict[str, str]:
    return dict(zip([t for t, _ in PROMPTS], hf_greedy(tiny_model_dir, PROMPTS), strict=True))


def counters(port: int) -> tuple[dict[str, float], list[float]]:
    """The speculation counters and the accepted tokens per position, from one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    totals = {m[1]: float(m[2]) for m in re.finditer(r"^tandem_spec_decode_(\w+)_total (\S+)$",
                                                      text, re.M)}
    at = [float(v) for v in re.findall(
        r'^tandem_spec_decode_num_accepted_tokens_per_pos_total\{position="\d+"\} (\S+)$',
        text, re.M)]
    return totals, at


def settled_counters(port: int) -> tuple[dict[str, float], list[float]]:
    """The counters once every plan's report is in: the scheduler reports every 0.2 s, so
    wait for drafts and then for two scrapes 0.3 s apart to agree."""
    last = counters(port)
    for _ in range(50):
        time.sleep(0.3)
        now = counters(port)
        if now == last and now[0].get("num_drafts", 0) > 0:
            break
        last = now
    return last


@pytest.mark.parametrize("steps, mode, method", [(8, "--async-postproc", "ngram"),
                                                 (1, "--no-async-postproc", "draft_model")])
def test_greedy_streams_with_speculation_equal_hf(tiny_model_dir: pathlib.Path,
                                                  hf_outputs: dict[str, str], steps: int,
                                                  mode: str, method: str) -> None:
    port = free_port()
    spec = SPEC if method == "ngram" else json.dumps(
        {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3,
         "adaptive": False})  # a draft as big as the target never pays: the rule would skip
    server = Server(str(tiny_model_dir), "--num-scheduler-steps", str(steps), mode,
                    "--speculative-config", spec, "--metrics-port", str(port)).wait_ready()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: stream_text(server, *p), PROMPTS))
        for (text, n), (got, count) in zip(PROMPTS, results, strict=True):
            assert count == n
            assert got == hf_outputs[text], f"K={steps} {mode}: {text!r}"
        seen, at = settled_counters(port)
        assert seen["num_drafts"] > 0 and seen["num_draft_tokens"] >= seen["num_drafts"]
        assert 0 <= seen["num_accepted_tokens"] <= seen["num_draft_tokens"]
        assert sum(at) == seen["num_accepted_tokens"], at
        if method == "draft_model":  # the target as its own draft: its drafts are kept
            assert seen["num_accepted_tokens"] >= 0.9 * seen["num_draft_tokens"]
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


@pytest.fixture(scope="module")
def copier(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Greedy output follows chains of tokens, so a prompt that already holds the chain gets
    its drafts accepted (as in the runner tests)."""
    from tests.gpu_worker.model_utils import make_copier_checkpoint

    return make_copier_checkpoint(tmp_path_factory.mktemp("copier"))


def hf_ids(model_dir: str, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_drafts_from_a_copy_heavy_prompt_are_accepted(copier: str) -> None:
    import openai
    from transformers import AutoTokenizer

    chain = [7] + hf_ids(copier, [7], 40)
    prompt = chain[:30] + chain[:3]  # copy-heavy: its continuation is in the prompt
    want = AutoTokenizer.from_pretrained(copier).decode(hf_ids(copier, prompt, 24),
                                                        skip_special_tokens=True)
    port = free_port()
    server = Server(copier, "--speculative-config", SPEC, "--metrics-port", str(port),
                    http=True).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                               api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        got = client.completions.create(model=name, prompt=prompt, max_tokens=24,
                                        temperature=0, extra_body={"min_tokens": 24})
        assert got.choices[0].text == want
        seen, _ = settled_counters(port)
        assert 0 < seen["num_accepted_tokens"] <= seen["num_draft_tokens"]
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []
