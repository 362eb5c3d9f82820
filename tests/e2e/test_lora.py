"""LoRA adapters end to end: a concurrent mix of adapters (and none) equals PEFT's generate(),
bad adapters get INVALID_ARGUMENT while the rest go on, and more adapters than slots in
flight all complete; over HTTP, the OpenAI `model` field names an adapter and /v1/models
lists them.

One server with an adapter cache at K=8 async (the defaults) and the HTTP API, and one at K=1
sync with only two adapter slots for three adapters plus the base model.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch

from tandem_serve.harness.metrics_scrape import Scrape
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running
from tests.hf_reference import hf_greedy
from tests.lora_utils import ADAPTERS, make_adapter, make_adapters

pytestmark = pytest.mark.slow

N = 12  # tokens per request (one value: a batched Generate call has one max_new_tokens)
PROMPTS = [("Once upon a time", N), ("The quick brown fox jumps over", N), ("1, 2, 3, 4,", N)]
# Longer than a KV block: the prefix cache would share it across adapters if it could.
SHARED = ("The tiny model reads this sentence twice, once with each adapter, and the cache "
          "must keep the two apart", 8)
VARIANTS: list[str | None] = [None, *ADAPTERS]


@pytest.fixture(scope="module")
def cache(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
          ) -> pathlib.Path:
    root = tmp_path_factory.mktemp("adapter-cache")
    make_adapters(tiny_model_dir, root / "team")
    make_adapter(tiny_model_dir, root / "big", r=32, lora_alpha=32, target_modules=["q_proj"])
    (root / "prompt-tuning").mkdir()
    (root / "prompt-tuning" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 8}))
    shutil.copytree(root / "team" / "attn", root / "fragile")
    return root


@pytest.fixture(scope="module")
def expected(tiny_model_dir: pathlib.Path, cache: pathlib.Path) -> dict[str | None, list[str]]:
    """Per variant: PEFT's text for each of PROMPTS, then for SHARED."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards on a shared box: more threads only wait
    try:
        for name in VARIANTS:
            out[name] = hf_greedy(tiny_model_dir, [*PROMPTS, SHARED],
                                  cache / "team" / name if name else None)
    finally:
        torch.set_num_threads(threads)
    for name in ADAPTERS:  # an adapter that changes nothing would make parity blind
        assert out[name] != out[None], name
    return out


def adapter_id(name: str | None) -> str:
    return f"team/{name}" if name else ""


def stream(server: Server, text: str, n: int, name: str | None) -> str:
    opts = GenerateOptions(max_new_tokens=n, min_new_tokens=n)
    return "".join(r.text for r in server.client.stream(text, opts, adapter_id=adapter_id(name)))


def batch(server: Server, name: str | None) -> list[str]:
    opts = GenerateOptions(max_new_tokens=N, min_new_tokens=N)
    resps = server.client.generate([t for t, _ in PROMPTS], opts, adapter_id=adapter_id(name))
    return [r.text for r in resps]


Texts = dict[str | None, list[str]]  # variant (None: no adapter) -> texts


def run_mix(server: Server) -> tuple[dict[tuple[str | None, int], str], Texts]:
    """Every variant x prompt as concurrent streams, and one batched Generate per variant."""
    jobs = [(name, i) for name in VARIANTS for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs) + len(VARIANTS)) as pool:
        streams = {job: pool.submit(stream, server, *PROMPTS[job[1]], job[0]) for job in jobs}
        batches = {name: pool.submit(batch, server, name) for name in VARIANTS}
        return ({k: f.result() for k, f in streams.items()},
                {k: f.result() for k, f in batches.items()})


def check_mix(server: Server, expected: dict[str | None, list[str]]) -> None:
    streams, batches = run_mix(server)
    for (name, i), text in streams.items():
        assert text == expected[name][i], f"stream {PROMPTS[i][0]!r} with {name or 'no adapter'}"
    for name, texts in batches.items():
        assert texts == expected[name][: len(PROMPTS)], f"Generate with {name or 'base'}"


# ------------------------------------------------------------------ K=8 async, 8 slots


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path, cache: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--adapter-cache", str(cache), http=True)


def test_concurrent_adapters_equal_peft(server: Server,
                                        expected: dict[str | None, list[str]]) -> None:
    check_mix(server, expected)
    # The same long prompt, run first without an adapter and then with one: its cached KV
    # must not be reused across adapters.
    for name in (None, "attn", "mlp"):
        assert stream(server, *SHARED, name) == expected[name][len(PROMPTS)], name
    info = server.client.model_info()
    assert {f"team/{n}" for n in ADAPTERS} <= set(info.loaded_adapters)
    assert set(server.client.stats().loaded_adapters) == set(info.loaded_adapters)


@pytest.mark.parametrize("bad, reason", [
    ("missing", "adapter 'missing': not found in the adapter cache"),
    ("../team/attn", "ids may only hold"),
    ("/etc", "relative to the adapter cache"),
    ("prompt-tuning", "peft_type is 'PROMPT_TUNING'; only LORA adapters are supported"),
    ("big", "rank 32, above this server's --max-lora-rank 16"),
])
def test_bad_adapters_are_invalid_while_others_complete(server: Server, bad: str, reason: str,
                                                        expected: dict[str | None, list[str]]
                                                        ) -> None:
    with ThreadPoolExecutor(1) as pool:
        text, n = PROMPTS[0]
        running_one = pool.submit(stream, server, text, n, "all")
        calls = {
            "GenerateStream": lambda: list(server.client.stream(text, adapter_id=bad)),
            "Generate": lambda: server.client.generate([text], adapter_id=bad),
            "Tokenize": lambda: server.client.tokenize([text], adapter_id=bad),
        }
        for rpc, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc
            assert "adapter_id" in err.value.details() and reason in err.value.details(), rpc
        assert running_one.result() == expected["all"][0]


def test_prefix_id_is_the_older_name_and_tokenize_uses_the_base_tokenizer(
        server: Server, expected: dict[str | None, list[str]]) -> None:
    from tandem_serve.proto import generation_pb2 as pb

    text, n = PROMPTS[1]
    req = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text), prefix_id="team/mlp",
        params=GenerateOptions(max_new_tokens=n, min_new_tokens=n).to_proto())
    assert "".join(r.text for r in server.client.stub.GenerateStream(req)) == \
        expected["mlp"][1]
    plain = server.client.tokenize([text], offsets=True)
    adapted = server.client.tokenize([text], offsets=True, adapter_id="team/attn")
    assert adapted == plain


def test_a_load_the_worker_cannot_do_is_invalid_too(server: Server, cache: pathlib.Path,
                                                    expected: dict[str | None, list[str]]
                                                    ) -> None:
    """The frontend validated the folder; then its header broke (same size and mtime, so the
    frontend's answer stands): the gpu worker's load fails and only that request fails."""
    server.client.tokenize(["x"], adapter_id="fragile")  # validated and cached
    path = cache / "fragile" / "adapter_model.safetensors"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[8:16] = b"{broken!"
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    text, n = PROMPTS[2]
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(stream, server, text, n, "attn")
        with pytest.raises(grpc.RpcError) as err:
            list(server.client.stream(text, GenerateOptions(max_new_tokens=4),
                                      adapter_id="fragile"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter 'fragile'" in err.value.details()
        assert "adapter_model.safetensors" in err.value.details()
        assert other.result() == expected["attn"][2]
    deadline = time.monotonic() + 5  # the frontend's view lags the scheduler's by 0.2 s
    while "fragile" in server.client.model_info().loaded_adapters:
        assert time.monotonic() < deadline, "a slot whose load failed is still reported"
        time.sleep(0.1)


def test_openai_model_field_names_an_adapter(server: Server, tiny_model_dir: pathlib.Path,
                                             expected: dict[str | None, list[str]]) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                           api_key="none", max_retries=0, timeout=120)
    base = tiny_model_dir.name  # no --served-model-name: the folder's name
    cards = {m.id: getattr(m, "parent", "?") for m in client.models.list().data}
    assert list(cards)[0] == base and cards[base] is None
    assert {f"team/{n}": base for n in ADAPTERS}.items() <= cards.items()
    assert "big" not in cards and "prompt-tuning" not in cards  # not servable: not listed

    def complete(name: str | None, i: int, stream: bool) -> str:
        args = dict(model=adapter_id(name) or base, prompt=PROMPTS[i][0], max_tokens=N,
                    temperature=0, extra_body={"min_tokens": N})
        if not stream:
            r = client.completions.create(**args)  # type: ignore[call-overload]
            assert r.model == args["model"]
            return str(r.choices[0].text)
        return "".join(c.choices[0].text for c in client.completions.create(
            stream=True, **args))  # type: ignore[call-overload]

    jobs = [(name, i, i == 1) for name in VARIANTS for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = {job: pool.submit(complete, *job) for job in jobs}
        for (name, i, _), future in got.items():
            assert future.result() == expected[name][i], (name, PROMPTS[i][0])
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="team/missing", prompt="x", max_tokens=1)
    assert "`team/missing` does not exist" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="big", prompt="x", max_tokens=1)
    assert "adapter 'big'" in bad.value.message and "--max-lora-rank 16" in bad.value.message


def test_vllm_lora_requests_info_names_the_running_adapters(server: Server) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                           api_key="none", max_retries=0, timeout=120)
    url = f"http://127.0.0.1:{server.http_port}/metrics"

    def until(want: dict[str, str]) -> dict[str, str]:  # the scheduler reports every 0.2 s
        deadline = time.monotonic() + 10
        while True:
            [labels] = Scrape(url).labels("vllm:lora_requests_info")
            if labels == want or time.monotonic() > deadline:
                return labels
            time.sleep(0.05)

    # The report can trail the last test's requests by an interval: start from none at all.
    idle = {"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert until(idle) == idle
    long = client.completions.create(model="team/attn", prompt="Once", max_tokens=1000,
                                     stream=True, extra_body={"min_tokens": 1000})
    next(iter(long))
    busy = {**idle, "running_lora_adapters": "team/attn"}
    assert until(busy) == busy
    long.close()
    assert until(idle) == idle


# ------------------------------------------------------------------ K=1 sync, 2 slots


def test_more_adapters_than_slots_all_complete_k1_sync(tiny_model_dir: pathlib.Path,
                                                       cache: pathlib.Path,
                                                       expected: dict[str | None, list[str]]
                                                       ) -> None:
    for server in running(str(tiny_model_dir), "--adapter-cache", str(cache),
                          "--max-loras", "2", "--num-scheduler-steps", "1",
                          "--no-async-postproc"):
        check_mix(server, expected)
        stats = server.wait_stats(lambda s: s.adapter_loads >= len(ADAPTERS) and not s.num_waiting)
        assert len(stats.loaded_adapters) == 2  # three adapters went through two slots
