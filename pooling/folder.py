"""A sentence-transformers model folder, read without torch (`PoolingSpec.read`).

What is read, as sentence-transformers and vLLM read it:

- `modules.json`: a Pooling module's folder (`1_Pooling/config.json`: mean, CLS or last-token
  pooling) and whether a Normalize module follows; a folder without modules.json, or whose
  model is `*ForSequenceClassification`, is a cross-encoder (scores, no vectors);
- the length limit: `sentence_bert_config.json`'s `max_seq_length`, else the tokenizer's
  `model_max_length`, else what the position embeddings allow;
- Matryoshka: config.json's `matryoshka_dimensions` (a list) or `is_matryoshka` (any size);
- a cross-encoder's activation: `config_sentence_transformers.json`'s `activation_fn` (or
  config.json's `sentence_transformers.activation_fn`), else sigmoid for one label.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

# architectures -> (whether attention is bidirectional, whether it is a cross-encoder)
ENCODERS = ("BertModel", "XLMRobertaModel", "RobertaModel")
CLASSIFIERS = ("BertForSequenceClassification", "XLMRobertaForSequenceClassification",
               "RobertaForSequenceClassification")
DECODERS = ("Qwen3Model", "Qwen3ForCausalLM", "Qwen2Model", "Qwen2ForCausalLM", "LlamaModel",
            "LlamaForCausalLM", "MistralModel", "MistralForCausalLM")
POOLING_MODES = ("mean", "cls", "lasttoken")
ACTIVATIONS = {"sigmoid": "sigmoid", "identity": "identity", "softmax": "softmax"}
_NO_LIMIT = 1_000_000  # a tokenizer_config model_max_length this large means "none set"


class PoolingFolderError(ValueError):
    """The folder is not a pooling model we serve; the message names the file and field."""


@dataclass(frozen=True)
class PoolingSpec:
    """What a pooling model does with its hidden states, and the limits a request meets."""

    architecture: str
    kind: str  # "embed" (vectors) or "classify" (a cross-encoder's scores)
    causal: bool  # a decoder (Qwen3-Embedding): no token types, prefix caching would apply
    hidden_size: int
    max_seq_length: int
    pooling: str = "cls"  # mean | cls | lasttoken (embed)
    normalize: bool = False
    matryoshka: tuple[int, ...] | None = None  # None: no dimensions; (): any size
    num_labels: int = 1
    activation: str = "identity"  # classify: sigmoid | identity | softmax
    type_vocab_size: int = 0  # token types a pair's second text takes (BERT: 2)

    @property
    def dimensions(self) -> int:
        return self.hidden_size if self.kind == "embed" else self.num_labels

    @property
    def uses_token_types(self) -> bool:
        return self.type_vocab_size > 1

    def dimension_problem(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served (None: it can)."""
        if self.matryoshka is None:
            return (f"this model does not support matryoshka representation, so dimensions "
                    f"must be left out (its vectors have {self.hidden_size})")
        if dimensions < 1 or dimensions > self.hidden_size:
            return f"must be between 1 and {self.hidden_size} (got {dimensions})"
        if self.matryoshka and dimensions not in self.matryoshka:
            return (f"must be one of {', '.join(map(str, self.matryoshka))} (got {dimensions})")
        return None

    @classmethod
    def read(cls, model_dir: str, max_model_len: int = 0) -> PoolingSpec:
        """The folder's spec; `max_model_len` (the flag; 0: none) lowers its length limit."""
        spec = cls._read(model_dir)
        if 0 < max_model_len < spec.max_seq_length:
            return dataclasses.replace(spec, max_seq_length=max_model_len)
        return spec

    @classmethod
    def _read(cls, model_dir: str) -> PoolingSpec:
        config = _json(model_dir, "config.json", required=True)
        archs = config.get("architectures") or []
        arch = str(archs[0]) if archs else ""
        if arch not in ENCODERS + CLASSIFIERS + DECODERS:
            raise PoolingFolderError(
                f"config.json: architecture {arch or '(none)'!r} is not a pooling model this "
                f"server runs; expected one of {', '.join(ENCODERS + CLASSIFIERS + DECODERS)}")
        causal = arch in DECODERS
        base = cls(architecture=arch, kind="embed", causal=causal,
                   hidden_size=int(config["hidden_size"]),
                   max_seq_length=_max_seq_length(model_dir, config),
                   type_vocab_size=0 if causal else int(config.get("type_vocab_size", 0)))
        if arch in CLASSIFIERS:
            labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
            return dataclasses.replace(base, kind="classify", num_labels=labels,
                                       activation=_activation(model_dir, config, labels))
        pooling, normalize = _modules(model_dir, causal)
        return dataclasses.replace(base, pooling=pooling, normalize=normalize,
                                   matryoshka=_matryoshka(config))


def _json(model_dir: str, name: str, required: bool = False) -> dict[str, Any]:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        if required:
            raise PoolingFolderError(f"{name} is missing from the model folder")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise PoolingFolderError(f"{name}: cannot read it: {exc}") from None
    if not isinstance(value, (dict, list)):
        raise PoolingFolderError(f"{name} is not a JSON object")
    return value if isinstance(value, dict) else {"__list__": value}


def _max_seq_length(model_dir: str, config: dict[str, Any]) -> int:
    st = _json(model_dir, "sentence_bert_config.json").get("max_seq_length")
    if isinstance(st, int) and st > 0:
        return st
    # XLM-R / RoBERTa number positions from padding_idx + 1: two fewer usable positions.
    positions = int(config.get("max_position_embeddings", 512))
    if config.get("model_type") in ("xlm-roberta", "roberta"):
        positions -= int(config.get("pad_token_id", 1)) + 1
    tok = _json(model_dir, "tokenizer_config.json").get("model_max_length")
    if isinstance(tok, (int, float)) and 0 < tok < _NO_LIMIT:
        return min(int(tok), positions)
    return positions


def _modules(model_dir: str, causal: bool) -> tuple[str, bool]:
    modules = _json(model_dir, "modules.json").get("__list__")
    if not isinstance(modules, list):
        # A bare model folder: vLLM's defaults (CLS for encoders, last token for decoders).
        return ("lasttoken" if causal else "cls"), False
    pooling, normalize = ("lasttoken" if causal else "cls"), False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            pooling = _pooling_mode(model_dir, str(module.get("path", "")))
        elif kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize


def _pooling_mode(model_dir: str, path: str) -> str:
    name = os.path.join(path, "config.json")
    cfg = _json(model_dir, name, required=True)
    mode = cfg.get("pooling_mode")
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode is None:  # sentence-transformers < 6: one flag per mode
        flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "lasttoken": "pooling_mode_lasttoken"}
        on = [m for m, flag in flags.items() if cfg.get(flag)]
        others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
                  and k not in flags.values()]
        mode = on[0] if len(on) == 1 and not others else None
    if mode not in POOLING_MODES:
        raise PoolingFolderError(f"{name}: pooling mode {mode!r} is not served; expected one "
                                 f"of {', '.join(POOLING_MODES)}")
    return str(mode)


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def _activation(model_dir: str, config: dict[str, Any], labels: int) -> str:
    path = _json(model_dir, "config_sentence_transformers.json").get("activation_fn") or \
        (config.get("sentence_transformers") or {}).get("activation_fn") or \
        config.get("sbert_ce_default_activation_function")
    if not path:
        return "sigmoid" if labels == 1 else "identity"
    name = str(path).rsplit(".", 1)[-1].lower()
    if name not in ACTIVATIONS:
        raise PoolingFolderError(f"activation_fn {path!r} is not served; expected torch's "
                                 f"Sigmoid, Identity or Softmax")
    return ACTIVATIONS[name]
