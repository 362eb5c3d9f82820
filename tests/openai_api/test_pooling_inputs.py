"""Pooling inputs to token ids as sentence-transformers' tokenizer call makes them: special
tokens and a pair's token types, `truncate_prompt_tokens` as HF's truncation (right side,
specials kept, the longer text of a pair first), limits and token ids named in 400s."""
from __future__ import annotations

import asyncio
import pathlib
import warnings

import pytest

from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.pooling.inputs import PoolingInputs
from tandem_serve.pooling.folder import PoolingSpec
from tandem_serve.tokenization.tokenizer import Tokenizer

LONG = " ".join(["river mountain city"] * 30)  # 90 words: over the limit of 64


def inputs(model_dir: pathlib.Path) -> PoolingInputs:
    tok = Tokenizer.from_dir(str(model_dir))
    return PoolingInputs(tok, PoolingSpec.read(str(model_dir)), tok.vocab_size)


def hf(model_dir: pathlib.Path):  # noqa: ANN201 - transformers' tokenizer
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("keep", [5, 12, 64])
def test_truncation_equals_hf(pooling_models: dict, keep: int) -> None:
    ours = inputs(pooling_models["bert-ce"])
    want = hf(pooling_models["bert-ce"])
    texts = ["hello world", LONG]
    got = asyncio.run(ours.texts(texts, ["a", "b"], ours.limit(keep)))
    ref = want(texts, truncation=True, max_length=keep)
    assert [e.ids for e in got] == ref["input_ids"]
    pairs = asyncio.run(ours.pairs(["search query", LONG], [LONG, "the dog"], ["a", "b"],
                                   ours.limit(keep)))
    ref = want(["search query", LONG], [LONG, "the dog"], truncation=True, max_length=keep)
    assert [e.ids for e in pairs] == ref["input_ids"]
    assert [e.types for e in pairs] == ref["token_type_ids"]


def test_limits_and_token_ids_name_the_input(pooling_models: dict) -> None:
    ours = inputs(pooling_models["bert"])
    with pytest.raises(ApiError) as over:
        asyncio.run(ours.texts(["ok", LONG], ["input[0]", "input[1]"], None))
    assert over.value.param == "input[1]" and "64" in over.value.message
    assert ours.limit(-1) == 64
    for bad in (0, 65):
        with pytest.raises(ApiError, match="truncate_prompt_tokens"):
            ours.limit(bad)
    assert ours.token_ids([[5, 6, 7]], ["input"], 2)[0].ids == [5, 6]
    with pytest.raises(ApiError, match="outside the vocabulary") as wrong:
        ours.token_ids([[5], [ours.vocab_size]], ["input[0]", "input[1]"], None)
    assert wrong.value.param == "input[1]"


def test_a_plain_body_is_validated_as_the_route_would() -> None:
    """What a caller without HTTP (a batch runner's request line) gets from `parse`."""
    from tandem_serve.openai_api.pooling.protocol import EmbeddingRequest
    from tandem_serve.openai_api.pooling.serving import parse

    assert parse(EmbeddingRequest, {"input": ["a", "b"], "dimensions": 8}).dimensions == 8
    for body, param in (({"input": 3.5}, "input"), ({"input": "a", "extra": 1}, "extra"),
                        ({"input": "a", "encoding_format": "hex"}, "encoding_format")):
        with pytest.raises(ApiError) as err:
            parse(EmbeddingRequest, body)
        assert err.value.status == 400 and err.value.param == param, err.value.message
