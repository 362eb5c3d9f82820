"""The HTTP app in this process over real uvicorn, on a scripted engine: status codes where
gRPC has status codes, OpenAI error objects, SSE framing, readiness, cancellation."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tandem_serve.adapters.peft import ModelShapes
from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.frontend import Frontend
from tandem_serve.frontend.validation import Limits
from tandem_serve.openai_api.app import build_app
from tandem_serve.openai_api.chat.serving import Serving
from tandem_serve.proto.request_params import FinishReason, OutputOptions, SamplingParams
from tandem_serve.proto.token_messages import OutputDelta
from tests.openai_api.http_thread import ThreadedServer, tok

LIMITS = Limits(max_model_len=256, max_new_tokens=64, default_max_new_tokens=16,
                vocab_size=32000, eos_token_ids=(2,), include_stop_sequence=True)


class ScriptedEngine:
    """Each request generates max_new_tokens tokens "w0 w1 ..." unless the prompt says
    otherwise: "reject" -> RESOURCE_EXHAUSTED before any token, "die" -> UNAVAILABLE after
    two tokens, "slow" -> 50 ms per token. Requests left before their end are aborted."""

    def __init__(self) -> None:
        self.ids = 0
        self.aborted: list[int] = []
        self.running = 0
        self.adapter_ids: list[str] = []  # each request's

    def new_request_id(self) -> int:
        self.ids += 1
        return self.ids

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       options: OutputOptions, deadline: float | None = None, name: str = "",
                       request_id: int | None = None, arrived: float | None = None,
                       guided: object = None, adapter_id: str = ""
                       ) -> AsyncIterator[OutputDelta]:
        rid = request_id or 0
        self.adapter_ids.append(adapter_id)
        text = tok().decode(prompt_ids)
        if "reject" in text:
            raise EngineError("RESOURCE_EXHAUSTED", "too many requests queued")
        done = False
        self.running += 1
        try:
            n = sampling.max_new_tokens
            for i in range(n):
                if "die" in text and i == 2:
                    raise EngineError("UNAVAILABLE", "gpu worker died")
                await asyncio.sleep(0.05 if "slow" in text else 0)
                reason = FinishReason.MAX_TOKENS if i == n - 1 else FinishReason.NOT_FINISHED
                done = i == n - 1
                yield OutputDelta(rid, f" w{i}" if i else "w0", i + 1, [100 + i],
                                  finish_reason=reason)
        finally:
            self.running -= 1
            if not done:
                self.aborted.append(rid)


class Running:
    def __init__(self, adapters: AdapterStore | None = None) -> None:
        self.engine = ScriptedEngine()
        self.frontend = Frontend(self.engine, tok(), adapters)  # type: ignore[arg-type]
        self.frontend.limits, self.frontend.serving = LIMITS, True
        app = build_app(Serving(self.frontend, ("tiny", "/models/tiny"), None))
        self.http = ThreadedServer(app)
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()


@pytest.fixture(scope="module")
def app() -> Iterator[Running]:
    running = Running()
    yield running
    running.stop()


@pytest.fixture()
def client(app: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.url + "/v1", api_key="none", max_retries=0)


def post(app: Running, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(app.url + path, json=body, timeout=10, **kw)


def test_models_and_unknown_model(app: Running, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").max_model_len == 256  # type: ignore[attr-defined]
    # The --model path is an alias; anything else is a 404 naming the parameter.
    assert client.completions.create(model="/models/tiny", prompt="a", max_tokens=2).choices
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="a")
    assert err.value.body["param"] == "model"  # type: ignore[index]
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_overload_is_429_before_any_byte(client: openai.OpenAI) -> None:
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="tiny", prompt="please reject", stream=True)
    assert "too many requests" in err.value.message
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt=["fine", "reject this"], max_tokens=3)


def test_failure_after_the_stream_started_is_an_error_event(app: Running) -> None:
    with httpx.stream("POST", app.url + "/v1/completions", timeout=10,
                      json={"prompt": "die soon", "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "service_unavailable_error"
    assert "gpu worker died" in error["error"]["message"]


def test_sse_framing_role_once_and_usage_last(app: Running) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", app.url + "/v1/chat/completions", json=body, timeout=10) as r:
        # No chat template on this server: a 400 naming messages, before any event.
        assert r.status_code == 400
        r.read()
        assert r.json()["error"]["param"] == "messages"
    with httpx.stream("POST", app.url + "/v1/completions", timeout=10,
                      json={"prompt": "hi", "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "w0 w1 w2"
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_n_choices_merge_in_openai_order(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == "w0 w1" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 8


def test_bad_bodies(app: Running) -> None:
    cases = [
        ({"prompt": "a", "nonsense": 1}, "nonsense", "unknown parameter"),
        ({"prompt": "a", "temperature": "hot"}, "temperature", "valid number"),
        ({"prompt": 5}, "prompt", "valid string"),
        ({"messages": []}, "prompt", "Field required"),
        ({"prompt": "a", "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x", "unknown parameter"),
        ({"prompt": [[1, 2], [3, 99999]]}, "prompt[1][1]", "token id must be in"),
    ]
    for body, param, text in cases:
        r = post(app, "/v1/completions", body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and text in err["message"], err
        assert err["type"] == "invalid_request_error"
    r = httpx.post(app.url + "/v1/completions", content=b"{nope", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(app.url + "/v1/completions", content=b"x" * (65 << 20), timeout=30)
    assert r.status_code == 413
    assert httpx.get(app.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(app.url + "/v1/completions").status_code == 405


# What sglang-router 0.3.2 adds to every body it forwards (captured from it).
ROUTER_COMPLETION = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                     "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}


def test_what_a_router_adds_passes_at_its_values_and_server_info(app: Running) -> None:
    r = post(app, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2,
                                      **ROUTER_COMPLETION})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "w0 w1", r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 2, **ROUTER_CHAT}
    # Without a reasoning parser either value changes nothing. This server has no chat
    # template, so the body passes validation and stops at the messages.
    for reasoning in (True, False):
        r = post(app, "/v1/chat/completions", {**chat, "separate_reasoning": reasoning,
                                               "stream_reasoning": reasoning})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    for field in ("no_stop_trim", "return_hidden_states"):
        for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", chat)):
            r = post(app, path, {**body, field: True})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and "only false" in r.text
    # What sglang-router reads when it registers a worker: the name to list the model by.
    info = httpx.get(app.url + "/server_info").json()
    assert info == {"served_model_name": "tiny", "model_path": "/models/tiny",
                    "context_length": 256}
    assert httpx.get(app.url + "/get_server_info").json() == info


def test_health_follows_readiness_and_metrics_are_served(app: Running) -> None:
    assert httpx.get(app.url + "/health").status_code == 200
    app.frontend.accepting = False
    try:
        r = httpx.get(app.url + "/health")
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        r = post(app, "/v1/completions", {"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    finally:
        app.frontend.accepting = True
    assert "tandem_time_to_first_token_seconds" in httpx.get(app.url + "/metrics").text


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_request(app: Running, stream: bool) -> None:
    before = list(app.engine.aborted)
    body = {"prompt": "slow one", "max_tokens": 60, "stream": stream}
    if stream:
        with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=10) as r:
            next(r.iter_lines())
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up, closing its connection
            httpx.post(app.url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 5
    while len(app.engine.aborted) == len(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(app.engine.aborted) == len(before) + 1
    assert app.engine.running == 0


# ------------------------------------------------------------------ LoRA adapters as models

SHAPES = ModelShapes(1, 32000, {m: (8, 8) for m in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj")})


def write_adapter(folder: Path, r: int = 2) -> None:
    """A one-layer LoRA folder for SHAPES (q_proj only), without torch."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({key + "A.weight": np.zeros((r, 8), np.float32),
               key + "B.weight": np.zeros((8, r), np.float32)},
              str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def lora_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    cache = tmp_path_factory.mktemp("http-adapters")
    for name in ("team/sql", "team/chat", "zeta"):
        write_adapter(cache / name)
    write_adapter(cache / "wide", r=32)  # over the store's max rank
    running = Running(AdapterStore(str(cache), SHAPES, max_rank=16))
    yield running
    running.stop()


def test_adapters_are_models(lora_app: Running) -> None:
    client = openai.OpenAI(base_url=lora_app.url + "/v1", api_key="none", max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "team/chat", "team/sql", "zeta"]  # "wide" is bad
    assert [getattr(m, "parent", "?") for m in models] == [None, "tiny", "tiny", "tiny"]
    assert client.models.retrieve("team/sql").parent == "tiny"  # type: ignore[attr-defined]
    before = len(lora_app.engine.adapter_ids)
    r = client.completions.create(model="team/sql", prompt="a", max_tokens=2)
    assert r.model == "team/sql" and r.choices[0].text == "w0 w1"
    chunks = list(client.completions.create(model="zeta", prompt=["a", "b"], max_tokens=1,
                                            stream=True))
    assert {c.model for c in chunks} == {"zeta"}
    assert client.completions.create(model="tiny", prompt="a", max_tokens=1).model == "tiny"
    assert lora_app.engine.adapter_ids[before:] == ["team/sql", "zeta", "zeta", ""]
    # Unknown names (a folder without an adapter config too) are 404s naming them.
    for name in ("team", "nope", "../zeta", "gpt-3.5-turbo"):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=name, prompt="a", max_tokens=1)
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == "model", body
        assert f"`{name}` does not exist" in body["message"], body
        assert "adapters" in body["message"]
    # An adapter that cannot be served is a 400 on `model` with the reason, before any token.
    for call in (lambda: client.completions.create(model="wide", prompt="a", max_tokens=1),
                 lambda: client.models.retrieve("wide")):
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "model"
        assert "adapter 'wide'" in bad.value.message and "--max-lora-rank 16" in \
            bad.value.message
    assert lora_app.engine.adapter_ids[before:] == ["team/sql", "zeta", "zeta", ""]


def test_pooling_routes_on_a_generation_server_name_the_runner(app: Running) -> None:
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/score"):
        r = post(app, path, {"input": "x"})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert "--runner generate" in error["message"] and error["code"] == "wrong_runner"
