"""HF parity of tokenization.tokenizer.Tokenizer: AutoTokenizer.from_pretrained(dir) judges."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem_serve.tokenization.tokenizer import Tokenizer, TokenizerLoadError
from tests.tokenizer_utils import (
    BPE_PLAIN_ADDED_TOKEN,
    BPE_SPECIAL_TOKENS,
    byte_level_bpe_dir,
    corpus_for,
    sentencepiece_dir,
    wordpiece_dir,
)

REPO = Path(__file__).resolve().parents[2]

FAMILIES: dict[str, tuple[Any, str, str]] = {
    "sentencepiece": (sentencepiece_dir, "<s>", "</s>"),
    "byte_level_bpe": (byte_level_bpe_dir, BPE_SPECIAL_TOKENS[0], BPE_SPECIAL_TOKENS[2]),
    "wordpiece": (wordpiece_dir, "[CLS]", "[SEP]"),
}


def _hf(model_dir: Path | str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[Tokenizer, Any, list[str]]:
    build, bos, eos = FAMILIES[request.param]
    model_dir = build()
    texts = corpus_for(bos, eos) + [
        f"{bos}{bos}x", f"{eos} tail", f"a{eos}b", f" {BPE_PLAIN_ADDED_TOKEN} x",
        "<unk> <pad> [UNK]", "I don't know , it's fine . you 're ok ? yes !",
    ]
    return Tokenizer.from_dir(str(model_dir)), _hf(model_dir), texts


def test_encode_matches_autotokenizer(family: tuple[Tokenizer, Any, list[str]]) -> None:
    tok, hf, texts = family
    for text in texts:
        assert tok.encode(text) == hf(text)["input_ids"], text


def test_offsets_match_autotokenizer(family: tuple[Tokenizer, Any, list[str]]) -> None:
    tok, hf, texts = family
    for text in texts:
        ids, offsets = tok.encode_with_offsets(text)
        want = hf(text, return_offsets_mapping=True)
        assert ids == want["input_ids"]
        assert offsets == [tuple(o) for o in want["offset_mapping"]], text


def test_decode_matches_autotokenizer(family: tuple[Tokenizer, Any, list[str]]) -> None:
    tok, hf, texts = family
    rng = random.Random(0)
    cases = [hf(t)["input_ids"] for t in texts]
    cases += [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for ids in cases:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)


def test_vocabulary_and_special_tokens(family: tuple[Tokenizer, Any, list[str]]) -> None:
    tok, hf, _ = family
    assert tok.vocab_size == len(hf)
    ids = list(range(len(hf)))
    assert [tok.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)
    assert tok.id_to_token(len(hf) + 10) == ""
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token == hf.eos_token
    assert set(hf.all_special_ids) <= tok.special_ids
    # special_ids is exactly what decode(skip_special_tokens=True) drops
    for i in tok.raw.get_added_tokens_decoder():
        dropped = hf.decode([i], skip_special_tokens=True) == "" != hf.decode([i])
        assert (i in tok.special_ids) == dropped, i


def test_sentencepiece_shape() -> None:
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    assert tok.vocab_size == 32000
    assert tok.id_to_token(13) == "<0x0A>"
    assert tok.encode("Hello")[0] == tok.bos_token_id == 1
    assert tok.eos_token_ids == [2]
    assert tok.id_to_token(tok.encode("Hello world")[-1]) == "▁world"


def test_byte_level_bpe_shape() -> None:
    tok = Tokenizer.from_dir(str(byte_level_bpe_dir()))
    assert 2000 <= tok.vocab_size <= 4100
    assert tok.eos_token == "<|end_of_text|>"
    # generation_config.json lists <|end_of_text|> and <|eot_id|>, as Llama-3 instruct does
    assert tok.eos_token_ids == [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    assert tok.token_to_id(BPE_PLAIN_ADDED_TOKEN) not in tok.special_ids
    assert tok.decode(tok.encode(f"a{BPE_PLAIN_ADDED_TOKEN}b")) == f"a{BPE_PLAIN_ADDED_TOKEN}b"
    assert tok.id_to_token(tok.encode(" world")[-1]).startswith("Ġ")


def test_word_cache_only_where_words_recur() -> None:
    """SentencePiece-style pipelines keep the whole text as one word: a cache of those held
    memory per distinct short prompt and was almost never hit, so it is off there; byte-level
    BPE splits into recurring words and keeps it. Encoding is the same either way (the parity
    tests above run with both)."""
    sp = Tokenizer.from_dir(str(sentencepiece_dir()))
    assert sp.raw.pre_tokenizer is not None
    assert len(sp.raw.pre_tokenizer.pre_tokenize_str("a b")) == 1
    assert not sp.word_cache
    assert Tokenizer.from_dir(str(byte_level_bpe_dir())).word_cache
    assert not Tokenizer.from_dir(str(wordpiece_dir())).word_cache  # no BPE, no such cache


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_eos_ids_precedence(tmp_path: Path) -> None:
    d = _copy(sentencepiece_dir(), tmp_path / "m")
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_dir(str(d)).eos_token_ids == [2]  # the tokenizer's eos token
    _edit_json(d / "config.json", eos_token_id=7)
    assert Tokenizer.from_dir(str(d)).eos_token_ids == [7]
    _edit_json(d / "generation_config.json", eos_token_id=[2, 9, 2])
    tok = Tokenizer.from_dir(str(d))
    assert tok.eos_token_ids == [2, 9]
    assert tok.eos_token == "</s>"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerLoadError, match="save_pretrained"):
        Tokenizer.from_dir(str(tmp_path))


def _assert_parity(model_dir: Path, texts: list[str]) -> None:
    tok, hf = Tokenizer.from_dir(str(model_dir)), _hf(model_dir)
    assert tok.vocab_size == len(hf)
    for text in texts:
        ids = hf(text)["input_ids"]
        assert tok.encode(text) == ids, text
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("legacy", [False, True])
def test_old_llama_tokenizer_json_is_rebuilt_like_transformers(
    tmp_path: Path, legacy: bool
) -> None:
    # Llama-2 checkpoints ship a Prepend/Replace normalizer and no pre-tokenizer; transformers 5
    # ignores both for LlamaTokenizer and encodes per the `legacy` flag instead.
    d = _copy(sentencepiece_dir(), tmp_path / "m")
    data = json.loads((d / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ]}
    data["pre_tokenizer"] = None
    (d / "tokenizer.json").write_text(json.dumps(data))
    _edit_json(d / "tokenizer_config.json", legacy=legacy)
    _assert_parity(d, corpus_for("<s>", "</s>") + ["<s>Hello", "a</s> b", "</s>b", " x"])


def test_config_added_and_named_tokens(tmp_path: Path) -> None:
    # Tokens declared only in tokenizer_config.json: an added_tokens_decoder entry, a named
    # special token that is a plain vocabulary token, an extra special token, an image token.
    d = _copy(byte_level_bpe_dir(), tmp_path / "m")
    n = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    _edit_json(
        d / "tokenizer_config.json",
        added_tokens_decoder={str(n + 5): {
            "content": "<|tool|>", "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True,
        }},
        unk_token="hello",
        extra_special_tokens=["<|extra|>"],
        image_token="<|image|>",
    )
    _assert_parity(d, ["say hello<|tool|>world<|extra|> <|image|>!", "hello", "<|tool|>"])
    tok = Tokenizer.from_dir(str(d))
    assert tok.token_to_id("hello") in tok.special_ids


def test_legacy_special_tokens_map_and_split_special_tokens(tmp_path: Path) -> None:
    d = _copy(byte_level_bpe_dir(), tmp_path / "m")
    (d / "special_tokens_map.json").write_text(json.dumps({
        "pad_token": {"content": "<|pad|>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False},
        "additional_special_tokens": ["<|legacy|>"],
    }))
    _assert_parity(d, ["a<|legacy|>b<|pad|>c"])
    _edit_json(d / "tokenizer_config.json", split_special_tokens=True)
    _assert_parity(d, ["a<|eot_id|>b<|begin_of_text|>"])


def test_tokenizer_and_postproc_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import tokenization.tokenizer, postproc_worker.detokenizer, postproc_worker.stops\n"
        f"t = tokenization.tokenizer.Tokenizer.from_dir({str(sentencepiece_dir())!r})\n"
        "d = postproc_worker.detokenizer.IncrementalDetokenizer(t, [1])\n"
        "assert d.add(t.encode('Hello world')) == 'Hello world'\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
