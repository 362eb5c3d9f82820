"""Priority scheduling and runtime LoRA adapters end to end, on one server with one seat
(`--max-num-seqs 1 --scheduling-policy priority`) and `--allow-runtime-lora-updating`:
a later high-priority request finishes before earlier low-priority ones (and the one it
preempted keeps its output), and an adapter loaded at runtime from a folder outside the
cache answers like PEFT, is listed, serves gRPC too, and is gone once unloaded."""
from __future__ import annotations

import json
import pathlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running
from tests.hf_reference import hf_greedy
from tests.lora_utils import ADAPTERS, make_adapter

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
N = 10


@pytest.fixture(scope="module")
def folders(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("runtime-lora")
    (root / "cache").mkdir()
    make_adapter(tiny_model_dir, root / "cache" / "in-cache", **ADAPTERS["mlp"])
    attn = make_adapter(tiny_model_dir, root / "elsewhere" / "attn.v1", **ADAPTERS["attn"])
    (root / "not-lora").mkdir()
    (root / "not-lora" / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    return {"cache": root / "cache", "attn": attn, "not-lora": root / "not-lora"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path, folders: dict[str, pathlib.Path]) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--served-model-name", MODEL, "--max-num-seqs", "1",
                       "--scheduling-policy", "priority", "--adapter-cache",
                       str(folders["cache"]), "--allow-runtime-lora-updating", http=True)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                         max_retries=0, timeout=120)


class Http:
    """POST a JSON body; the status and the body's text."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def post(self, path: str, json_body: dict[str, Any]) -> tuple[int, str]:
        req = urllib.request.Request(self.base + path, json.dumps(json_body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@pytest.fixture(scope="module")
def http(server: Server) -> Http:
    return Http(server.http_port)


def test_a_later_high_priority_request_finishes_first(client: openai.OpenAI,
                                                      server: Server) -> None:
    finished: list[str] = []
    texts: dict[str, str] = {}
    first_token = threading.Event()

    def run(name: str, priority: int, n: int) -> None:
        out = []
        for chunk in client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=n, temperature=0,
                stream=True, extra_body={"min_tokens": n, "priority": priority}):
            out.append(chunk.choices[0].text)
            first_token.set()
        texts[name] = "".join(out)
        finished.append(name)

    low = [threading.Thread(target=run, args=(name, 5, 400)) for name in ("low-1", "low-2")]
    low[0].start()
    assert first_token.wait(60)  # low-1 holds the only seat
    low[1].start()  # and low-2 waits behind it
    time.sleep(0.05)
    # `high` must arrive while low-1 runs (its 400 tokens take 50 plans); whether before or
    # after low-2 does not change the order the policy gives.
    high = threading.Thread(target=run, args=("high", 0, 8))
    high.start()
    for t in [*low, high]:
        t.join(120)
    assert finished == ["high", "low-1", "low-2"]
    # low-1 was preempted for `high` and resumed: its output is low-2's, untouched.
    assert texts["low-1"] == texts["low-2"]
    assert server.wait_stats(lambda s: s.num_preemptions >= 1).num_preemptions == 1


def test_runtime_adapter_loads_serves_like_peft_and_unloads(
        client: openai.OpenAI, http: Http, server: Server,
        tiny_model_dir: pathlib.Path, folders: dict[str, pathlib.Path]) -> None:
    job = ("The quick brown fox jumps over", N)
    [want] = hf_greedy(tiny_model_dir, [job], folders["attn"])
    [plain] = hf_greedy(tiny_model_dir, [job])
    assert want != plain  # the adapter changes the output

    status, text = http.post("/v1/load_lora_adapter", {"lora_name": "attn",
                                                       "lora_path": str(folders["attn"])})
    assert status == 200, text
    assert text == "Success: LoRA adapter 'attn' added successfully."
    listed = {m.id: m for m in client.models.list().data}
    assert listed["attn"].parent == MODEL  # type: ignore[attr-defined]
    assert "in-cache" in listed  # the cache's adapters are still listed

    def complete(model: str) -> str:
        r = client.completions.create(model=model, prompt=job[0], max_tokens=N, temperature=0,
                                      extra_body={"min_tokens": N})
        assert r.model == model
        return r.choices[0].text

    assert complete("attn") == want
    assert complete(MODEL) == plain
    opts = GenerateOptions(max_new_tokens=N, min_new_tokens=N)
    assert "".join(x.text for x in server.client.stream(job[0], opts, adapter_id="attn")) == want

    status, text = http.post("/v1/unload_lora_adapter", {"lora_name": "attn"})
    assert status == 200 and "removed successfully" in text
    with pytest.raises(openai.NotFoundError):
        complete("attn")
    assert "attn" not in {m.id for m in client.models.list().data}


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "must be provided"),
    ("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "{attn}"}, 400, "lora_name",
     "already served"),
    ("/v1/load_lora_adapter", {"lora_name": "in-cache", "lora_path": "{attn}"}, 400,
     "lora_name", "already served"),
    ("/v1/load_lora_adapter", {"lora_name": "bad name!", "lora_path": "{attn}"}, 400,
     "lora_name", "letters, digits"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"}, 404,
     "lora_path", "No adapter found"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "{not-lora}"}, 400, "lora_path",
     "LORA"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "{attn}", "frob": 1}, 400,
     "frob", ""),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name",
     "cannot be found"),
])
def test_runtime_adapter_errors(http: Http, folders: dict[str, pathlib.Path],
                                path: str, body: dict[str, object], status: int, param: str,
                                message: str) -> None:
    body = {k: v.format(**folders) if isinstance(v, str) else v for k, v in body.items()}
    got, text = http.post(path, body)
    assert got == status, text
    error = json.loads(text)["error"]
    assert error["param"] == param and message in error["message"]


def test_loading_a_name_twice_needs_load_inplace(http: Http,
                                                 folders: dict[str, pathlib.Path]) -> None:
    body: dict[str, Any] = {"lora_name": "twice", "lora_path": str(folders["attn"])}
    assert http.post("/v1/load_lora_adapter", body)[0] == 200
    status, text = http.post("/v1/load_lora_adapter", body)
    assert status == 400 and "already been loaded" in json.loads(text)["error"]["message"]
    assert http.post("/v1/load_lora_adapter", {**body, "load_inplace": True})[0] == 200
    assert http.post("/v1/unload_lora_adapter", {"lora_name": "twice"})[0] == 200
