"""The pooling runner against sentence-transformers, the oracle: every model kind's vectors
(or a cross-encoder's activated scores) within 1e-4, in input order, batched with rows of
different lengths, from ids our own tokenizer made."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from tandem_serve.gpu_worker.pooling.runner import PoolingRunner
from tandem_serve.pooling.folder import PoolingSpec
from tandem_serve.proto.pooling_messages import PoolRequest
from tandem_serve.tokenization.tokenizer import Tokenizer

TEXTS = ["hello world", "the cat and the dog are in the house",
         "a blue river in the mountain city at night", "query", "Fast search engine!",
         "water, fire; light & dark?"]
PAIRS = [("hello world", "the cat"), ("search query", "a document about music and paper"),
         ("blue", "red green blue"), ("river", "mountain")]


def _requests(model_dir: str, texts: list, pairs: bool, types: bool) -> list[PoolRequest]:
    raw = Tokenizer.from_dir(model_dir).raw
    out = []
    for i, enc in enumerate(raw.encode_batch(texts)):
        tt = np.array(enc.type_ids if types else [], dtype=np.int32)
        out.append(PoolRequest(i, np.array(enc.ids, dtype=np.int32), tt, 0.0))
    return out


def _runner(model_dir: str) -> PoolingRunner:
    spec = PoolingSpec.read(model_dir)
    return PoolingRunner(model_dir, spec, torch.device("cpu"), torch.float32)


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


@pytest.mark.parametrize("kind", ["bert", "xlmr", "qwen3"])
def test_embeddings_equal_sentence_transformers(kind: str, pooling_models: dict,
                                                one_torch_thread: None) -> None:
    from sentence_transformers import SentenceTransformer

    model_dir = str(pooling_models[kind])
    runner = _runner(model_dir)
    reqs = _requests(model_dir, TEXTS, False, runner.spec.uses_token_types)
    ours = _unit(runner.run(reqs))  # the frontend normalises (the folder has Normalize)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(model_dir, device="cpu")
    want = st.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert ours.shape == want.shape
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
    assert np.abs(want[0] - want[1]).max() > 1e-2  # texts differ: the check has teeth
    # One at a time: padding in a batch changes nothing.
    alone = _unit(np.concatenate([runner.run([r]) for r in reqs]))
    np.testing.assert_allclose(alone, ours, atol=1e-5, rtol=0)
    runner.chunk_rows = 2  # sorted by length into chunks, then back in input order
    np.testing.assert_allclose(_unit(runner.run(reqs)), ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["bert-ce", "xlmr-ce"])
def test_cross_encoder_equals_predict(kind: str, pooling_models: dict,
                                      one_torch_thread: None) -> None:
    from sentence_transformers import CrossEncoder

    model_dir = str(pooling_models[kind])
    runner = _runner(model_dir)
    assert runner.spec.activation == "sigmoid"
    logits = runner.run(_requests(model_dir, PAIRS, True, runner.spec.uses_token_types))
    ours = 1 / (1 + np.exp(-logits[:, 0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ce = CrossEncoder(model_dir, device="cpu")
    want = ce.predict(PAIRS, convert_to_numpy=True)
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
    assert np.ptp(want) > 1e-3  # the pairs score differently: the check has teeth
