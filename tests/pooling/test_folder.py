"""Reading sentence-transformers folders without torch: pooling modes (6.x and older
spellings), Normalize, the length limit's sources, Matryoshka, a cross-encoder's activation,
and folders we do not serve, named by file and field."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tandem_serve.pooling.folder import PoolingFolderError, PoolingSpec

BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32,
        "max_position_embeddings": 512, "type_vocab_size": 2}


def folder(tmp_path: pathlib.Path, config: dict[str, Any], files: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return str(tmp_path)


def modules(*kinds: str) -> list[dict[str, Any]]:
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    return [{"idx": i, "name": str(i), "path": paths[k],
             "type": f"sentence_transformers.models.{k}"} for i, k in enumerate(kinds)]


def test_mean_pooling_normalised_with_its_limit(tmp_path: pathlib.Path) -> None:
    spec = PoolingSpec.read(folder(tmp_path, BERT, {
        "modules.json": modules("Transformer", "Pooling", "Normalize"),
        "1_Pooling/config.json": {"embedding_dimension": 32, "pooling_mode": "mean"},
        "sentence_bert_config.json": {"max_seq_length": 256}}))
    assert (spec.kind, spec.pooling, spec.normalize, spec.max_seq_length) == \
        ("embed", "mean", True, 256)
    assert PoolingSpec.read(str(tmp_path), max_model_len=100).max_seq_length == 100
    assert PoolingSpec.read(str(tmp_path), max_model_len=1000).max_seq_length == 256
    assert spec.uses_token_types and not spec.causal and spec.matryoshka is None
    assert "does not support matryoshka" in (spec.dimension_problem(16) or "")


def test_older_pooling_flags_and_limits_from_the_tokenizer(tmp_path: pathlib.Path) -> None:
    config = {**BERT, "architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta",
              "max_position_embeddings": 514, "pad_token_id": 1, "type_vocab_size": 1,
              "matryoshka_dimensions": [8, 16, 32]}
    spec = PoolingSpec.read(folder(tmp_path, config, {
        "modules.json": modules("Transformer", "Pooling"),
        "1_Pooling/config.json": {"word_embedding_dimension": 32,
                                  "pooling_mode_cls_token": True,
                                  "pooling_mode_mean_tokens": False},
        "tokenizer_config.json": {"model_max_length": 1e30}}))
    assert (spec.pooling, spec.normalize, spec.max_seq_length) == ("cls", False, 512)
    assert not spec.uses_token_types
    assert spec.dimension_problem(16) is None
    assert "one of 8, 16, 32" in (spec.dimension_problem(12) or "")
    assert "between 1 and 32" in (spec.dimension_problem(33) or "")


def test_decoder_last_token_and_any_matryoshka_size(tmp_path: pathlib.Path) -> None:
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "max_position_embeddings": 32768, "is_matryoshka": True}
    spec = PoolingSpec.read(folder(tmp_path, config, {
        "modules.json": modules("Transformer", "Pooling", "Normalize"),
        "1_Pooling/config.json": {"pooling_mode": "lasttoken"},
        "tokenizer_config.json": {"model_max_length": 8192}}))
    assert (spec.causal, spec.pooling, spec.max_seq_length) == (True, "lasttoken", 8192)
    assert spec.dimension_problem(17) is None


@pytest.mark.parametrize(("files", "activation"), [
    ({}, "sigmoid"),
    ({"config_sentence_transformers.json": {"activation_fn": "torch.nn.modules.linear.Identity"}},
     "identity"),
])
def test_cross_encoder_activation(tmp_path: pathlib.Path, files: dict, activation: str) -> None:
    config = {**BERT, "architectures": ["BertForSequenceClassification"],
              "id2label": {"0": "LABEL_0"}}
    spec = PoolingSpec.read(folder(tmp_path, config, files))
    assert (spec.kind, spec.num_labels, spec.activation) == ("classify", 1, activation)


@pytest.mark.parametrize(("config", "files", "says"), [
    ({**BERT, "architectures": ["LlavaForConditionalGeneration"]}, {}, "architecture"),
    (BERT, {"modules.json": modules("Transformer", "Pooling"),
            "1_Pooling/config.json": {"pooling_mode": "max"}}, "1_Pooling/config.json"),
    (BERT, {"modules.json": modules("Transformer", "Pooling")}, "1_Pooling/config.json"),
])
def test_folders_we_do_not_serve_are_named(tmp_path: pathlib.Path, config: dict,
                                           files: dict, says: str) -> None:
    with pytest.raises(PoolingFolderError, match=says.replace(".", r"\.")):
        PoolingSpec.read(folder(tmp_path, config, files))
