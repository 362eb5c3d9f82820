"""The OpenAI-compatible HTTP API end to end, with the official `openai` client (sync and
async, stream and not) against one real server: parity with HF, usage, chat templates,
stops, seeds, logprobs, n, bad parameters beside a live stream, 32 streams, disconnects."""
from __future__ import annotations

import asyncio
import math
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tandem_serve.harness.metrics_scrape import Scrape
from tests.e2e.server import Server, running

pytestmark = pytest.mark.slow

PROMPTS = [("Once upon a time", 12), ("The quick brown fox jumps over", 7),
           ("Tandem runs the model while", 9), ("1, 2, 3, 4,", 10)]
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a tandem bicycle?"}]
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--served-model-name", MODEL, http=True)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                         max_retries=0, timeout=120)


class HF:
    """HF generate() on the same checkpoint in float32: the judge."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[Any]]:
        """Exactly n greedy tokens (EOS held back as min_tokens does) and the log-softmax of
        the processed scores at each step, which is what the engine's logprobs describe."""
        t = self.torch.tensor([ids])
        out = self.model.generate(t, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):].tolist()
        return gen, [self.torch.log_softmax(s[0], -1) for s in out.scores]

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([ids])).logits[0]
        lp = self.torch.log_softmax(logits[:-1], -1)
        return [float(lp[i, t]) for i, t in enumerate(ids[1:])]

    def text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def hf(tiny_model_dir: pathlib.Path) -> HF:
    return HF(tiny_model_dir)


def exactly(n: int, extra: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    """Greedy, exactly n tokens: min_tokens (a vLLM extension) keeps EOS from ending it."""
    return dict(model=MODEL, max_tokens=n, temperature=0,
                extra_body={"min_tokens": n, **(extra or {})}, **kw)


def test_greedy_completions_equal_hf_stream_and_not(client: openai.OpenAI, hf: HF) -> None:
    for text, n in PROMPTS:
        ids = hf.tok(text).input_ids
        want = hf.text(hf.greedy(ids, n)[0])
        r = client.completions.create(prompt=text, **exactly(n))
        assert r.choices[0].text == want, text
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
        parts, usage = [], None
        for chunk in client.completions.create(prompt=text, stream=True,
                                               stream_options={"include_usage": True},
                                               **exactly(n)):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            else:
                usage = chunk.usage
        assert "".join(parts) == want
        assert usage is not None and usage.total_tokens == len(ids) + n


def test_chat_prompt_is_hf_chat_template_ids_and_greedy_equals_hf(client: openai.OpenAI,
                                                                   hf: HF) -> None:
    ids = list(hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    gen, _ = hf.greedy(ids, 10)
    args = exactly(10, {"return_token_ids": True})
    args["max_completion_tokens"] = args.pop("max_tokens")
    r = client.chat.completions.create(messages=CHAT, **args)
    choice = r.choices[0]
    assert choice.prompt_token_ids == ids  # type: ignore[attr-defined]
    assert choice.token_ids == gen  # type: ignore[attr-defined]
    assert choice.message.content == hf.text(gen)
    assert choice.message.role == "assistant"
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    # Streamed: the role once, then content that adds up to the same text.
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **exactly(10)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == hf.text(gen)


def test_logit_bias_moves_greedy_tokens(client: openai.OpenAI, hf: HF) -> None:
    """-100 bans the greedy favourites, +100 forces one token at every step; beside an
    unbiased request, which keeps HF's greedy output."""
    ids = list(hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    gen, _ = hf.greedy(ids, 6)
    banned = {str(t): -100 for t in set(gen)}
    forced = next(t for t in range(100, 200) if t not in gen)

    def chat(bias: dict[str, int]) -> list[int]:
        r = client.chat.completions.create(messages=CHAT, logit_bias=bias,  # type: ignore[arg-type]
                                           **exactly(6, {"return_token_ids": True}))
        return list(r.choices[0].token_ids)  # type: ignore[attr-defined]

    assert not set(chat(banned)) & set(gen)
    assert chat({str(forced): 100}) == [forced] * 6
    assert chat({}) == gen


def test_stop_strings(client: openai.OpenAI, hf: HF) -> None:
    text, n = PROMPTS[0]
    full = hf.text(hf.greedy(hf.tok(text).input_ids, n)[0])
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = client.completions.create(prompt=text, stop=[stop, "never here"], **exactly(n))
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (full[: full.index(stop)], "stop")
    assert c.stop_reason == stop  # type: ignore[attr-defined]
    kept = client.completions.create(prompt=text, stop=stop,
                                     **exactly(n, {"include_stop_str_in_output": True}))
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


def test_seeds_and_n(client: openai.OpenAI, hf: HF) -> None:
    sample = dict(model=MODEL, prompt="Seeded sampling:", max_tokens=12, temperature=1.0,
                  top_p=0.95)
    a = client.completions.create(seed=7, **sample).choices[0].text
    assert client.completions.create(seed=7, **sample).choices[0].text == a
    three = client.completions.create(seed=7, n=3, **sample)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts[0] == a  # choice j samples with seed + j
    assert client.completions.create(seed=8, **sample).choices[0].text == texts[1]
    assert len(set(texts)) > 1
    text, n = PROMPTS[1]
    want = hf.text(hf.greedy(hf.tok(text).input_ids, n)[0])
    greedy = client.completions.create(prompt=text, n=2, **exactly(n))
    assert [c.text for c in greedy.choices] == [want, want]
    assert greedy.usage is not None and greedy.usage.completion_tokens == 2 * n


def test_logprobs_equal_hf(client: openai.OpenAI, hf: HF) -> None:
    text, n = PROMPTS[2]
    ids = hf.tok(text).input_ids
    gen, scores = hf.greedy(ids, n)
    r = client.completions.create(prompt=text, logprobs=3, echo=True, **exactly(n))
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    prompt_lps, gen_lps = lp.token_logprobs[: len(ids)], lp.token_logprobs[len(ids):]
    assert prompt_lps[0] is None  # nothing precedes the first token
    assert all(math.isclose(a, b, abs_tol=1e-3)  # type: ignore[arg-type]
               for a, b in zip(prompt_lps[1:], hf.prompt_logprobs(ids), strict=True))
    for j, (token, s) in enumerate(zip(gen, scores, strict=True)):
        assert math.isclose(gen_lps[j], float(s[token]), abs_tol=1e-3)  # type: ignore[arg-type]
        top = sorted(lp.top_logprobs[len(ids) + j].values(), reverse=True)[:3]
        want = hf.torch.topk(s, 3).values.tolist()
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(top, want, strict=True))
    assert r.choices[0].text.startswith(text)
    chat = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2,
                                          **exactly(4))
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    ids = list(hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    gen, scores = hf.greedy(ids, 4)
    assert content is not None and len(content) == 4
    for entry, token, s in zip(content, gen, scores, strict=True):
        assert math.isclose(entry.logprob, float(s[token]), abs_tol=1e-3)
        assert len(entry.top_logprobs) == 2
        assert math.isclose(entry.top_logprobs[0].logprob, float(s.max()), abs_tol=1e-3)


BAD: list[tuple[str, dict[str, Any]]] = [
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("max_tokens", {"max_tokens": 100000}),
    ("n", {"n": 0}),
    ("logprobs", {"logprobs": 11}),
    ("stop", {"stop": ["a"] * 7}),
    ("presence_penalty", {"presence_penalty": 5}),
    ("logit_bias", {"logit_bias": {"5": 101}}),
    ("priority", {"extra_body": {"priority": 1}}),  # needs --scheduling-policy priority
    ("suffix", {"suffix": "tail"}),
    ("guided_regex", {"extra_body": {"guided_regex": "(unclosed"}}),
    ("response_format.json_schema.schema", {"extra_body": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}}}),
    ("frobnicate", {"extra_body": {"frobnicate": True}}),
    ("model", {"model": "gpt-4"}),
    ("prompt", {"prompt": ""}),
]


def test_every_bad_parameter_is_a_400_while_a_stream_completes(client: openai.OpenAI,
                                                               hf: HF) -> None:
    text, n = PROMPTS[3]
    want = hf.text(hf.greedy(hf.tok(text).input_ids, 40)[0])
    got: list[str] = []
    stream = threading.Thread(target=lambda: got.extend(
        c.choices[0].text for c in client.completions.create(prompt=text, stream=True,
                                                             **exactly(40))))
    stream.start()
    for param, kw in BAD:
        args = {"model": MODEL, "prompt": "bad", "max_tokens": 2, **kw}
        expected = openai.NotFoundError if param == "model" else openai.BadRequestError
        with pytest.raises(expected) as err:
            client.completions.create(**args)
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == param, body
        assert param in body["message"] or param == "model", body
    stream.join(120)
    assert "".join(got) == want
    # Runtime LoRA's routes exist only with --allow-runtime-lora-updating.
    with pytest.raises(openai.NotFoundError):
        client.post("/load_lora_adapter", cast_to=str,
                    body={"lora_name": "x", "lora_path": str(pathlib.Path.cwd())})


def test_32_concurrent_async_streams(server: Server, hf: HF) -> None:
    wants = {t: hf.text(hf.greedy(hf.tok(t).input_ids, n)[0]) for t, n in PROMPTS}

    async def main() -> list[tuple[str, str]]:
        aclient = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                     api_key="none", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, str]:
            text, n = PROMPTS[i % len(PROMPTS)]
            parts = []
            async for chunk in await aclient.completions.create(prompt=text, stream=True,
                                                                **exactly(n)):
                parts.append(chunk.choices[0].text)
            return text, "".join(parts)

        try:
            results = await asyncio.gather(*(one(i) for i in range(32)))
            single = await aclient.completions.create(prompt=PROMPTS[0][0],
                                                      **exactly(PROMPTS[0][1]))
            results.append((PROMPTS[0][0], single.choices[0].text))
            return results
        finally:
            await aclient.close()

    for text, got in asyncio.run(main()):
        assert got == wants[text]


def wait_idle(server: Server) -> Any:
    return server.wait_stats(lambda s: (s.num_running, s.num_waiting, s.num_free_blocks)
                      == (0, 0, s.num_total_blocks))


def test_a_client_that_disconnects_frees_its_blocks(client: openai.OpenAI,
                                                    server: Server) -> None:
    wait_idle(server)
    streams = [client.completions.create(prompt=f"Story {i}:", stream=True, **exactly(1000))
               for i in range(3)]
    for s in streams:
        next(iter(s))
    busy = server.wait_stats(lambda s: s.num_running == 3)
    assert busy.num_free_blocks < busy.num_total_blocks
    for s in streams:
        s.close()
    slow = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                         max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):  # a JSON answer it stops waiting for
        slow.completions.create(prompt="A long one", **exactly(1000))
    before = wait_idle(server).tokens_delivered
    time.sleep(0.5)  # nothing keeps generating for the clients that left
    assert wait_idle(server).tokens_delivered == before
    # The server goes on serving.
    assert client.completions.create(prompt="Still there?", **exactly(3)).choices[0].text


def test_vllm_metrics_move_by_exactly_the_usage(client: openai.OpenAI, server: Server) -> None:
    url = f"http://127.0.0.1:{server.http_port}/metrics"
    wait_idle(server)
    # Earlier tests' prefix-cache queries reach /metrics with the scheduler's next reports
    # (every 0.2 s): start once they have stopped moving.
    before = Scrape(url)
    while True:
        time.sleep(0.5)
        now = Scrape(url)
        if now.total("vllm:prefix_cache_queries_total") == \
                before.total("vllm:prefix_cache_queries_total"):
            break
        before = now
    long = " ".join(f"word{i}" for i in range(40))  # several KV blocks: its repeat hits them
    used = [client.completions.create(prompt=["Once upon a time", long], **exactly(5)).usage,
            client.completions.create(prompt=long, **exactly(2)).usage]
    *_, last = client.completions.create(prompt="Tandem runs", stream=True, **exactly(
        4, stream_options={"include_usage": True}))
    used.append(last.usage)
    used.append(client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=3,
                                               temperature=0).usage)
    requests = 5
    after = Scrape(url)

    def moved(name: str, scrape: Scrape = after, **labels: str) -> float:
        return scrape.total(name, **labels) - before.total(name, **labels)

    assert all(u is not None for u in used)
    assert moved("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in used if u)
    assert moved("vllm:generation_tokens_total") == sum(u.completion_tokens for u in used if u)
    assert moved("vllm:request_success_total") == requests
    assert moved("vllm:request_success_total", finished_reason="length") >= requests - 1
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert moved(f"vllm:{histogram}_seconds_count") == requests
    itl = moved("vllm:inter_token_latency_seconds_count")
    assert 0 < itl <= moved("vllm:generation_tokens_total") - requests
    # Every family with vLLM's labels: the served name, engine 0.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert after.labels(name) == [{"model_name": MODEL, "engine": "0"}], name
    [info] = after.labels("vllm:cache_config_info")
    assert int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0
    assert {"tandem_time_to_first_token_seconds_count", "vllm:request_success_total"} <= {
        n for n, _, _ in after.samples}
    # The prefix-cache counters follow the scheduler's reports (every 0.2 s): every prompt
    # token was queried once (nothing was preempted), and the repeated prompt hit.
    deadline = time.monotonic() + 10
    while moved("vllm:prefix_cache_queries_total", scrape := Scrape(url)) \
            < moved("vllm:prompt_tokens_total") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert moved("vllm:prefix_cache_queries_total", scrape) == moved("vllm:prompt_tokens_total")
    assert moved("vllm:prefix_cache_hits_total", scrape) >= int(info["block_size"])
