"""The pooling endpoints' work: `embeddings`, `rerank` and `score`, each a coroutine from a
request body to the response dict (or an `ApiError`), so callers other than the HTTP routes
(a batch runner reading request lines) reuse them as they are.

Vectors come from the gpu worker pooled and unnormalised; what depends on the request is
done here: the cut to `dimensions` (Matryoshka) and then the folder's normalisation, a
cross-encoder's activation, cosine similarity for an embedding model's scores.
"""
from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.frontend import Frontend
from tandem_serve.frontend.pooling import PoolingRejected
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.models import Models
from tandem_serve.openai_api.pooling.inputs import Encoded, PoolingInputs, bad
from tandem_serve.openai_api.pooling.protocol import (
    EmbeddingRequest,
    RerankDocument,
    RerankRequest,
    ScoreRequest,
)
from tandem_serve.pooling.folder import PoolingSpec

Body = TypeVar("Body", bound=BaseModel)


def parse(cls: type[Body], body: Body | dict[str, Any]) -> Body:
    """A parsed body as is; a plain dict validated, its first error a 400 naming the field."""
    if isinstance(body, cls):
        return body
    try:
        return cls.model_validate(body)
    except PydanticError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)
                         and p not in ("str", "int", "list[int]", "list[str]"))
        raise ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}",
                       param or None, "invalid_parameter") from None


def _activate(logits: np.ndarray, activation: str) -> np.ndarray:
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if activation == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return logits


def _unit(rows: np.ndarray) -> np.ndarray:
    """As torch's F.normalize: rows over max(norm, 1e-12)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


class PoolingServing:
    def __init__(self, frontend: Frontend, spec: PoolingSpec, models: Models) -> None:
        self.frontend = frontend
        self.spec = spec
        self.models = models
        self._inputs: PoolingInputs | None = None

    def _ready(self) -> PoolingInputs:
        try:
            limits = self.frontend.ready_limits()
        except EngineError as exc:
            raise ApiError.from_engine(exc) from None
        if self._inputs is None:
            self._inputs = PoolingInputs(self.frontend.tok, self.spec, limits.vocab_size)
        return self._inputs

    def _count(self, n: int, param: str) -> None:
        """Each input is one engine request: more than the queue holds could never run."""
        limit = self.frontend.engine.cfg.max_queued_requests
        if n > limit:
            raise bad(param, f"{n} inputs, over this server's limit of {limit} per request "
                             f"(--max-queued-requests); split them over several requests")

    async def _pool(self, encoded: Sequence[Encoded], arrived: float) -> np.ndarray:
        pooler = self.frontend.engine.pooler
        types = [e.types for e in encoded] if self.spec.uses_token_types else None
        try:
            return await pooler.run([e.ids for e in encoded], types, arrived)
        except PoolingRejected as exc:
            raise ApiError(429, str(exc), None, "rate_limit_exceeded") from None
        except EngineError as exc:
            raise ApiError.from_engine(exc) from None

    # ------------------------------------------------------------------ /v1/embeddings

    async def embeddings(self, body: EmbeddingRequest | dict[str, Any]) -> dict[str, Any]:
        arrived = time.monotonic()
        req = parse(EmbeddingRequest, body)
        inputs = self._ready()
        name = self.models.resolve(req.model).name
        if self.spec.kind != "embed":
            raise bad("model", f"{name} is a cross-encoder (it scores text pairs): use "
                               f"/v1/rerank or /score")
        if req.dimensions is not None:
            problem = self.spec.dimension_problem(req.dimensions)
            if problem:
                raise bad("dimensions", problem)
        keep = inputs.limit(req.truncate_prompt_tokens)
        encoded = await self._embedding_inputs(inputs, req.input, keep)
        rows = self._vectors(await self._pool(encoded, arrived), req.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode_vector(row, req.encoding_format)}
                for i, row in enumerate(rows)]
        tokens = sum(len(e.ids) for e in encoded)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _embedding_inputs(self, inputs: PoolingInputs, given: Any,
                                keep: int | None) -> list[Encoded]:
        if isinstance(given, str):
            return await inputs.texts([given], ["input"], keep)
        if not given:
            raise bad("input", "must not be empty")
        self._count(len(given), "input")
        params = [f"input[{i}]" for i in range(len(given))]
        if isinstance(given[0], str):
            return await inputs.texts(given, params, keep)
        if isinstance(given[0], int):  # one list of token ids
            return inputs.token_ids([given], ["input"], keep)
        return inputs.token_ids(given, params, keep)

    def _vectors(self, rows: np.ndarray, dimensions: int | None) -> np.ndarray:
        if dimensions is not None:
            rows = rows[:, :dimensions]
        return _unit(rows) if self.spec.normalize else rows

    # ------------------------------------------------------------------ rerank and score

    async def rerank(self, body: RerankRequest | dict[str, Any]) -> dict[str, Any]:
        arrived = time.monotonic()
        req = parse(RerankRequest, body)
        inputs = self._ready()
        name = self.models.resolve(req.model).name
        if not req.query:
            raise bad("query", "must not be empty")
        if not req.documents:
            raise bad("documents", "must not be empty")
        self._count(len(req.documents) + 1, "documents")
        docs = [d.text if isinstance(d, RerankDocument) else d for d in req.documents]
        params = [f"documents[{i}]" for i in range(len(docs))]
        scores, tokens = await self._scores(inputs, [req.query] * len(docs), docs,
                                            ("query", params), req.truncate_prompt_tokens,
                                            arrived)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if req.return_documents:
                result["document"] = {"text": docs[i]}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(self, body: ScoreRequest | dict[str, Any]) -> dict[str, Any]:
        arrived = time.monotonic()
        req = parse(ScoreRequest, body)
        inputs = self._ready()
        name = self.models.resolve(req.model).name
        firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if not firsts:
            raise bad("text_1", "must not be empty")
        if not seconds:
            raise bad("text_2", "must not be empty")
        self._count(len(firsts) + len(seconds), "text_2")
        for i, text in enumerate(firsts):
            if not text:
                raise bad("text_1" if isinstance(req.text_1, str) else f"text_1[{i}]",
                          "must not be empty")
        if len(firsts) == 1:  # one-to-one or one-to-many
            firsts = firsts * len(seconds)
            params_1 = ["text_1"] * len(seconds)
        elif len(firsts) != len(seconds):
            raise bad("text_2", f"must be one text or as many as text_1 ({len(firsts)}), "
                                f"paired element by element (got {len(seconds)})")
        else:
            params_1 = [f"text_1[{i}]" for i in range(len(firsts))]
        params_2 = ["text_2"] if isinstance(req.text_2, str) else \
            [f"text_2[{i}]" for i in range(len(seconds))]
        scores, tokens = await self._scores(inputs, firsts, seconds, (params_1, params_2),
                                            req.truncate_prompt_tokens, arrived)
        data = [{"index": i, "object": "score", "score": float(s)}
                for i, s in enumerate(scores)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(self, inputs: PoolingInputs, firsts: list[str], seconds: list[str],
                      params: tuple[Any, Any], truncate: int | None, arrived: float
                      ) -> tuple[np.ndarray, int]:
        """One score per pair: a cross-encoder's activated logit, or the cosine similarity
        of an embedding model's two vectors; and the prompt tokens it took."""
        keep = inputs.limit(truncate)
        first_params = params[0] if isinstance(params[0], list) else [params[0]] * len(firsts)
        if self.spec.kind == "classify":
            if self.spec.num_labels != 1:
                raise bad("model", f"scores need a cross-encoder with one label (this one "
                                   f"has {self.spec.num_labels})")
            encoded = await inputs.pairs(firsts, seconds, params[1], keep)
            logits = await self._pool(encoded, arrived)
            scores = _activate(logits, self.spec.activation)[:, 0]
            return scores, sum(len(e.ids) for e in encoded)
        unique = list(dict.fromkeys(firsts))  # the query once, not once per document
        left = await inputs.texts(unique, [first_params[firsts.index(t)] for t in unique],
                                  keep)
        right = await inputs.texts(seconds, params[1], keep)
        rows = _unit(await self._pool(left + right, arrived))
        index = {text: i for i, text in enumerate(unique)}
        a = rows[[index[t] for t in firsts]]
        b = rows[len(unique):]
        return (a * b).sum(axis=-1), sum(len(e.ids) for e in left + right)


def _encode_vector(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()  # Python floats of the float32 values
