"""`tandem serve --runner pooling` end to end: embeddings with the official `openai` client,
rerank and score over HTTP, against sentence-transformers (vectors and CrossEncoder.predict
within 1e-4, exact usage), 16 concurrent requests equal to sequential ones, bad input a 400
naming the field, generation routes a 400 naming the runner, the vLLM counters."""
from __future__ import annotations

import base64
import concurrent.futures
import json
import pathlib
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from tandem_serve.harness.metrics_scrape import Scrape
from tandem_serve.rpc.client import GenerateOptions
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.e2e.server import Server, running

pytestmark = pytest.mark.slow

TEXTS = ["hello world", "the cat and the dog are in the house",
         "a blue river in the mountain city at night", "Fast search engine!", "query"]
QUERY = "search query about music"
DOCS = ["a document about music and paper", "the dog", "red green blue water",
        "search engine music model", "fire"]


@pytest.fixture(scope="module")
def embed_server(pooling_models: dict[str, pathlib.Path]) -> Iterator[Server]:
    yield from running(str(pooling_models["bert"]), "--runner", "pooling", http=True)


@pytest.fixture(scope="module")
def ce_server(pooling_models: dict[str, pathlib.Path]) -> Iterator[Server]:
    yield from running(str(pooling_models["bert-ce"]), "--runner", "pooling", http=True)


@pytest.fixture(scope="module")
def client(embed_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{embed_server.http_port}/v1",
                         api_key="none", max_retries=0, timeout=60)


def _st(model_dir: pathlib.Path) -> Any:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(model_dir), device="cpu")


class Reply:
    def __init__(self, status_code: int, text: str) -> None:
        self.status_code, self.text = status_code, text

    def json(self) -> Any:
        return json.loads(self.text)


def post(server: Server, path: str, body: dict[str, Any]) -> Reply:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}",
                                 json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read().decode())


def test_embeddings_equal_sentence_transformers(client: openai.OpenAI, embed_server: Server,
                                                pooling_models: dict) -> None:
    st = _st(pooling_models["bert"])
    want = st.encode(TEXTS, convert_to_numpy=True)
    got = client.embeddings.create(input=TEXTS, model="bert", encoding_format="float")
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, atol=1e-4)
    tok = Tokenizer.from_dir(str(pooling_models["bert"]))
    assert got.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    assert got.usage.total_tokens == got.usage.prompt_tokens
    # One string, token ids (used as given), base64.
    one = client.embeddings.create(input=TEXTS[1], model="bert", encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=1e-4)
    ids = [tok.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(input=ids, model="bert", encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in by_ids.data], want[:2], atol=1e-4)
    raw = post(embed_server, "/v1/embeddings",
               {"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, want[0], atol=1e-4)


def test_dimensions_and_truncation(client: openai.OpenAI, embed_server: Server,
                                  pooling_models: dict) -> None:
    st = _st(pooling_models["bert"])
    full = st.encode(TEXTS[:2], convert_to_numpy=True, normalize_embeddings=False)
    got = client.embeddings.create(input=TEXTS[:2], model="bert", dimensions=16)
    cut = full[:, :16] / np.linalg.norm(full[:, :16], axis=-1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in got.data], cut, atol=1e-4)
    long = " ".join(["river mountain"] * 40)  # 80 words: over max_seq_length 64
    server = embed_server
    over = post(server, "/v1/embeddings", {"input": ["ok", long]})
    assert over.status_code == 400 and over.json()["error"]["param"] == "input[1]"
    assert "64" in over.json()["error"]["message"]
    cut_to = post(server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": 10})
    assert cut_to.status_code == 200 and cut_to.json()["usage"]["prompt_tokens"] == 10
    st.max_seq_length = 10  # sentence-transformers truncates the same way (specials kept)
    np.testing.assert_allclose(cut_to.json()["data"][0]["embedding"],
                               st.encode([long], convert_to_numpy=True)[0], atol=1e-4)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[]]}, "input[0]"),
    ({"input": [1, 10**6]}, "input"),
    ({"input": "a", "dimensions": 12}, "dimensions"),
    ({"input": "a", "dimensions": 64}, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
    ({"input": 3.5}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "nonsense": 1}, "nonsense"),
    ({"input": ["a"] * 1025}, "input"),  # over --max-queued-requests (1024)
])
def test_bad_input_is_a_400_naming_the_field(embed_server: Server, body: dict,
                                             param: str) -> None:
    r = post(embed_server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_16_concurrent_equal_sequential(client: openai.OpenAI) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} {' '.join(['tree'] * (i % 7))}" for i in range(16)]
    one = [client.embeddings.create(input=t, model="bert").data[0].embedding for t in texts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        many = list(pool.map(
            lambda t: client.embeddings.create(input=t, model="bert").data[0].embedding, texts))
    np.testing.assert_allclose(np.array(many), np.array(one), atol=1e-5)


def test_generation_routes_name_the_runner_and_models_lists_it(client: openai.OpenAI,
                                                               embed_server: Server) -> None:
    server = embed_server
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        r = post(server, path, {"prompt": "x"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as rpc:  # gRPC generation too
        list(server.client.stream("x", GenerateOptions(max_new_tokens=2)))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--runner pooling" in (rpc.value.details() or "")
    [card] = client.models.list().data
    assert card.id == "bert" and card.model_extra["max_model_len"] == 64


def test_embedding_model_scores_are_cosine_similarity(embed_server: Server,
                                                      pooling_models: dict) -> None:
    st = _st(pooling_models["bert"])
    q, d = st.encode([QUERY], convert_to_numpy=True), st.encode(DOCS, convert_to_numpy=True)
    r = post(embed_server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
    np.testing.assert_allclose([x["score"] for x in r["data"]], (q @ d.T)[0], atol=1e-4)


def test_metrics_count_prompt_tokens_and_requests(client: openai.OpenAI,
                                                  embed_server: Server) -> None:
    url = f"http://127.0.0.1:{embed_server.http_port}/metrics"
    before = Scrape(url)
    used = client.embeddings.create(input=TEXTS, model="bert").usage
    after = Scrape(url)
    moved = {n: after.total(n) - before.total(n)
             for n in ("vllm:prompt_tokens_total", "vllm:request_success_total")}
    assert moved == {"vllm:prompt_tokens_total": used.prompt_tokens,
                     "vllm:request_success_total": len(TEXTS)}
    # The scheduler's reports (every 0.2 s, so they lag) drive the running / waiting gauges.
    deadline = time.monotonic() + 10
    while True:
        scrape = Scrape(url)
        gauges = [scrape.labels(f"vllm:num_requests_{g}") for g in ("running", "waiting")]
        idle = all(gauges) and scrape.total("vllm:num_requests_running") == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, gauges


def _predict(model_dir: pathlib.Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CrossEncoder(str(model_dir), device="cpu").predict(pairs, convert_to_numpy=True)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_equals_cross_encoder(ce_server: Server, pooling_models: dict,
                                     path: str) -> None:
    want = _predict(pooling_models["bert-ce"], [(QUERY, d) for d in DOCS])
    docs: list[Any] = [DOCS[0], *({"text": d} for d in DOCS[1:])]
    r = post(ce_server, path, {"query": QUERY, "documents": docs, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = list(np.argsort(-want, kind="stable")[:3])
    assert [x["index"] for x in results] == order
    np.testing.assert_allclose([x["relevance_score"] for x in results], want[order],
                               atol=1e-4)
    assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order]
    tok = Tokenizer.from_dir(str(pooling_models["bert-ce"]))
    assert r.json()["usage"]["prompt_tokens"] == sum(
        len(tok.raw.encode(QUERY, d).ids) for d in DOCS)
    bare = post(ce_server, path, {"query": QUERY, "documents": DOCS,
                                  "return_documents": False}).json()["results"]
    assert len(bare) == len(DOCS) and "document" not in bare[0]


def test_score_shapes_equal_cross_encoder(ce_server: Server, pooling_models: dict) -> None:
    pairs = [(QUERY, DOCS[0]), ("blue", DOCS[2]), ("fire", DOCS[4])]
    want = _predict(pooling_models["bert-ce"], pairs)
    one = post(ce_server, "/score", {"text_1": QUERY, "text_2": DOCS[0]}).json()
    np.testing.assert_allclose(one["data"][0]["score"], want[0], atol=1e-4)
    many = post(ce_server, "/score", {"text_1": [p[0] for p in pairs],
                                      "text_2": [p[1] for p in pairs]}).json()
    assert [x["index"] for x in many["data"]] == [0, 1, 2]
    np.testing.assert_allclose([x["score"] for x in many["data"]], want, atol=1e-4)
    fan = post(ce_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS[:2]}).json()
    np.testing.assert_allclose([x["score"] for x in fan["data"]],
                               _predict(pooling_models["bert-ce"],
                                        [(QUERY, d) for d in DOCS[:2]]), atol=1e-4)
    for body, param in (({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                        ({"text_1": ["a", ""], "text_2": ["c", "d"]}, "text_1[1]"),
                        ({"text_1": "a", "text_2": []}, "text_2")):
        bad = post(ce_server, "/score", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    for body, param in (({"query": "", "documents": ["a"]}, "query"),
                        ({"query": "a", "documents": ["b", {"text": ""}]}, "documents[1]"),
                        ({"query": "a", "documents": [{"txt": "b"}]}, "documents[0]"),
                        ({"query": "a", "documents": ["b"], "top_n": -1}, "top_n")):
        bad = post(ce_server, "/v1/rerank", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    emb = post(ce_server, "/v1/embeddings", {"input": "a"})
    assert emb.status_code == 400 and emb.json()["error"]["param"] == "model"


def embed_one(server: Server, text: str) -> Reply:
    return post(server, "/v1/embeddings", {"input": text})


def test_decoder_embedding_model_over_two_ranks(pooling_models: dict) -> None:
    """Qwen3-Embedding-style last-token pooling, the model split over two gpu worker ranks
    (tensor parallelism over gloo): equal to sentence-transformers, concurrent or not."""
    model_dir = pooling_models["qwen3"]
    want = _st(model_dir).encode(TEXTS, convert_to_numpy=True)
    started = []
    for server in running(str(model_dir), "--runner", "pooling", "--tensor-parallel-size",
                          "2", http=True):
        started.append(server)
        assert sum(1 for name in server.role_pids() if name.startswith("gpu-worker")) == 2
        with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
            replies = list(pool.map(partial(embed_one, server), TEXTS))
        got = np.array([r.json()["data"][0]["embedding"] for r in replies])
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert started and started[0].leftovers() == []  # stopped with exit 0, nothing left


def test_run_batch_embeddings_lines_equal_the_server(embed_server: Server,
                                                     pooling_models: dict[str, pathlib.Path],
                                                     tmp_path: pathlib.Path) -> None:
    """`tandem run-batch --runner pooling`: /v1/embeddings lines answer as the server does;
    a generation line gets the app's 400 naming the runner, and the rest still run."""
    import subprocess

    from tandem_serve.ipc.process import CLI

    bodies = [{"input": TEXTS[:2]}, {"input": TEXTS[2], "encoding_format": "float"}]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b}
             for i, b in enumerate(bodies)]
    lines.append({"custom_id": "g", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "x"}})
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([*CLI, "run-batch", "-i", str(src), "-o", str(out), "--model",
                           str(pooling_models["bert"]), "--runner", "pooling"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["e0", "e1", "g"]
    for body, r in zip(bodies, results[:2], strict=True):
        want = post(embed_server, "/v1/embeddings", body).json()
        got = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and got["usage"] == want["usage"]
        for a, b in zip(got["data"], want["data"], strict=True):
            np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
    assert results[2]["response"]["status_code"] == 400
    assert results[2]["response"]["body"]["error"]["code"] == "wrong_runner"
    assert "2 succeeded, 1 failed" in done.stderr
