"""The offline `LLM` and the rollout controls, end to end: one `LLM` and one server
(`--enable-control-endpoints`) shared by the module, HF `generate()` as the judge."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tandem_serve import LLM, SamplingParams
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [("The capital of France is", 12), ("Once upon a time there", 9)]
CHAT = [{"role": "user", "content": "Say something about the sea."}]


def exactly(n: int, **kw: Any) -> SamplingParams:
    """Greedy, exactly n tokens (min_tokens keeps EOS from ending it early)."""
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, **kw)


@pytest.fixture(scope="module")
def weights_b(tmp_path_factory: pytest.TempPathFactory,
              tiny_model_dir: pathlib.Path) -> pathlib.Path:
    """The tiny model's architecture with other weights (the next training step's)."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("weights-b")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(7)
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    save_file({k: (v + 0.05 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v)
               .contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def llm(tiny_model_dir: pathlib.Path) -> Iterator[LLM]:
    engine = LLM(str(tiny_model_dir), num_postproc_workers=1, num_scheduler_steps=4)
    launcher = engine.engine.launcher
    assert launcher is not None
    children, run_dir = list(launcher.children), launcher.run_dir
    ring = launcher.cfg.addresses.ring_name
    try:
        yield engine
    finally:
        engine.shutdown()
    # Nothing left behind: processes, run folder (sockets), shared-memory ring.
    assert all(c.proc.poll() is not None for c in children)
    assert not os.path.exists(run_dir)
    assert not ring or not os.path.exists(f"/dev/shm/{ring.lstrip('/')}")


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--enable-control-endpoints",
                       "--num-postproc-workers", "1", "--num-scheduler-steps", "4", http=True)


def post(server: Server, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}",
                                 data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def test_generate_greedy_equals_hf_and_the_server(llm: LLM, server: Server,
                                                  tiny_model_dir: pathlib.Path) -> None:
    outs = llm.generate([t for t, _ in PROMPTS], [exactly(n) for _, n in PROMPTS])
    assert [o.outputs[0].text for o in outs] == hf_greedy(tiny_model_dir, PROMPTS)
    for (text, n), out in zip(PROMPTS, outs, strict=True):
        assert out.prompt == text and len(out.outputs[0].token_ids) == n
        assert out.outputs[0].finish_reason == "length"
        answer = post(server, "/v1/completions", {"prompt": text, "max_tokens": n,
                                                  "min_tokens": n, "temperature": 0})
        assert answer["choices"][0]["text"] == out.outputs[0].text


def test_token_id_prompts_and_seeded_samples(llm: LLM) -> None:
    text, n = PROMPTS[0]
    by_text = llm.generate(text, exactly(n))[0]
    by_ids = llm.generate({"prompt_token_ids": by_text.prompt_token_ids}, exactly(n))[0]
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    seeded = SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=8, min_tokens=8,
                            logprobs=2)
    first, again = (llm.generate(text, seeded)[0].outputs for _ in range(2))
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert first[0].token_ids != first[1].token_ids
    # Sample i samples with seed + i: the second is a lone request seeded 12.
    alone = llm.generate(text, SamplingParams(seed=12, max_tokens=8, min_tokens=8))[0]
    assert alone.outputs[0].token_ids == first[1].token_ids
    for tid, entry in zip(first[0].token_ids, first[0].logprobs or [], strict=True):
        assert tid in entry and len(entry) in (2, 3)  # the chosen one and the top 2


def test_chat_equals_chat_completions(llm: LLM, server: Server) -> None:
    out = llm.chat(CHAT, exactly(10))[0]
    answer = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10,
                                                   "min_tokens": 10, "temperature": 0})
    assert answer["choices"][0]["message"]["content"] == out.outputs[0].text


def test_sleep_wake_and_reload_give_identical_outputs(llm: LLM,
                                                      tiny_model_dir: pathlib.Path) -> None:
    prompts, params = [t for t, _ in PROMPTS], [exactly(n) for _, n in PROMPTS]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.sleep(1)
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before
    llm.sleep(2)
    # A request that arrives while asleep waits for wake_up (no error).
    waiting: list[Any] = []
    thread = threading.Thread(target=lambda: waiting.append(llm.generate(prompts, params)))
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and not waiting
    llm.load_weights(str(tiny_model_dir))
    llm.wake_up()
    thread.join(60)
    assert [o.outputs[0].token_ids for o in waiting[0]] == before
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before


def test_load_weights_b_equals_hf_on_b(llm: LLM, weights_b: pathlib.Path,
                                       tiny_model_dir: pathlib.Path) -> None:
    prompts, params = [t for t, _ in PROMPTS], [exactly(n) for _, n in PROMPTS]
    a = [o.outputs[0].text for o in llm.generate(prompts, params)]
    llm.load_weights(str(weights_b))
    try:
        b = [o.outputs[0].text for o in llm.generate(prompts, params)]
        assert b == hf_greedy(weights_b, PROMPTS) and b != a
    finally:
        llm.load_weights(str(tiny_model_dir))
    assert [o.outputs[0].text for o in llm.generate(prompts, params)] == a


def test_bad_input_names_the_field_and_the_engine_goes_on(llm: LLM, tmp_path: pathlib.Path
                                                          ) -> None:
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="path"):
        llm.load_weights(str(tmp_path / "nothing-here"))
    with pytest.raises(TypeError, match="no_such_flag"):
        LLM("unused", no_such_flag=1)
    assert llm.generate("hi", exactly(3))[0].outputs[0].finish_reason == "length"


def sse_stream(server: Server, body: dict[str, Any], chunks: list[str],
               started: threading.Event) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()


def test_stream_across_pause_and_resume_finishes_with_hf_tokens(
        server: Server, tiny_model_dir: pathlib.Path) -> None:
    text, n = "A long story begins", 60
    chunks: list[str] = []
    started = threading.Event()
    body = {"prompt": text, "max_tokens": n, "min_tokens": n, "temperature": 0}
    thread = threading.Thread(target=sse_stream, args=(server, body, chunks, started))
    thread.start()
    assert started.wait(60)
    t0 = time.monotonic()
    post(server, "/pause")
    assert time.monotonic() - t0 < 2.0  # at once: it does not wait for the stream
    thread.join(1.5)
    assert thread.is_alive()  # paused: no plan runs, the stream waits (it does not fail)
    post(server, "/resume")
    thread.join(60)
    assert "".join(chunks) == hf_greedy(tiny_model_dir, [(text, n)])[0]


def test_reset_prefix_cache_leaves_no_prefix_hit(server: Server) -> None:
    text = " ".join(f"word{i}" for i in range(60))  # several full KV blocks
    opts = GenerateOptions(max_new_tokens=2)
    server.client.generate([text], opts)
    server.client.generate([text], opts)
    hits = server.wait_stats(lambda s: s.prefix_hit_tokens > 0).prefix_hit_tokens
    answer = post(server, "/reset_prefix_cache")
    assert answer["status"] == "ok" and answer["detail"].split()[0] != "0"
    server.client.generate([text], opts)
    time.sleep(0.5)  # two stats reports
    assert server.client.stats().prefix_hit_tokens == hits


def test_run_batch_lines_equal_the_server_and_bad_lines_do_not_stop_the_file(
        llm: LLM, server: Server) -> None:
    from tqdm import tqdm

    from tandem_serve.openai_api.app import build_app
    from tandem_serve.tandem.offline.run_batch import parse_line, run_lines, summary

    completion = {"prompt": PROMPTS[0][0], "max_tokens": 6, "min_tokens": 6, "temperature": 0}
    chat = {"messages": CHAT, "max_tokens": 6, "min_tokens": 6, "temperature": 0}
    raw = [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": completion},
           {"custom_id": "h", "method": "POST", "url": "/v1/chat/completions", "body": chat},
           {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
           {"custom_id": "u", "method": "POST", "url": "/v1/nothing", "body": {}},
           {"custom_id": "b", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "x", "temperature": -2}}]
    lines = [parse_line(i, json.dumps(r)) for i, r in enumerate(raw, 1)]
    lines.append(parse_line(len(lines) + 1, "{not json"))
    with tqdm(total=len(lines), disable=True) as bar:
        out = llm.engine.call(run_lines(build_app(llm.engine.serving), lines, 4, bar))
    assert [r["custom_id"] for r in out] == ["c", "h", "e", "u", "b", None]
    c, h, e, u, b, bad = out
    assert c["response"]["body"]["choices"][0]["text"] == \
        post(server, "/v1/completions", completion)["choices"][0]["text"]
    assert h["response"]["body"]["choices"][0]["message"]["content"] == \
        post(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    assert c["response"]["status_code"] == 200 and c["error"] is None
    assert e["response"]["status_code"] == 400 and e["error"] is None  # the app's own answer
    assert e["response"]["body"]["error"]["code"] == "wrong_runner"
    assert u["error"]["code"] == "invalid_url"
    assert b["response"]["status_code"] == 400
    assert b["response"]["body"]["error"]["param"] == "temperature"
    assert bad["error"]["code"] == "invalid_json"
    assert summary(out, 1.0).startswith("run-batch: 6 requests in 1.0 s: 2 succeeded, 4 failed")


def test_tensor_parallel_ranks_load_new_weights_while_asleep(
        weights_b: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    """Every rank reads its own shard: a rank left on the old weights would change the
    gathered logits."""
    with LLM(str(tiny_model_dir), num_postproc_workers=1, tensor_parallel_size=2,
             reserved_cpus=0) as tp:
        tp.sleep(2)
        tp.load_weights(str(weights_b))
        tp.wake_up()
        outs = tp.generate([t for t, _ in PROMPTS], [exactly(n) for _, n in PROMPTS])
    assert [o.outputs[0].text for o in outs] == hf_greedy(weights_b, PROMPTS)


def test_http_sleep_holds_requests_until_wake_up(server: Server,
                                                 tiny_model_dir: pathlib.Path) -> None:
    body = {"prompt": PROMPTS[1][0], "max_tokens": 5, "min_tokens": 5, "temperature": 0}
    before = post(server, "/v1/completions", body)["choices"][0]["text"]
    assert post(server, "/sleep?level=2")["op"] == "sleep"
    url = f"http://127.0.0.1:{server.http_port}/is_sleeping"
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert json.loads(resp.read()) == {"is_sleeping": True}
    answers: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: answers.append(post(server, "/v1/completions",
                                                                 body)))
    thread.start()
    thread.join(1.0)
    assert thread.is_alive()  # it waits for wake_up, it is not refused
    assert post(server, "/load_weights", {"path": str(tiny_model_dir)})["status"] == "ok"
    post(server, "/wake_up")
    thread.join(60)
    assert answers[0]["choices"][0]["text"] == before
