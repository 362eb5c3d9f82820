"""Tiny random pooling models saved as sentence-transformers folders, for tests and
`tandem bench pooling`: BERT and XLM-R encoders (mean / CLS pooling, normalised), a
Qwen3-Embedding-style decoder (last-token pooling), and BERT / XLM-R cross-encoders.

Deterministic from a seed, built offline: the tokenizers are small WordPiece vocabularies
made with `tokenizers`, with each family's special tokens and pair templates.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORDS = ("the a of to and in is it that for on with as was at by this be are from or an but "
         "not hello world query document cat dog fish bird tree house car blue red green "
         "river mountain city music paper search engine vector model text small large fast "
         "slow day night water fire light dark good bad new old").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"
KINDS = ("bert", "xlmr", "qwen3", "bert-ce", "xlmr-ce")
SIZE: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64)
# The shape of all-MiniLM-L6-v2 (a BERT), for benchmarks: its compute per token, random weights.
MINILM: dict[str, Any] = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                              intermediate_size=1536)


def _tokenizer(specials: list[str], single: str, pair: str, lowercase: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = specials + list(WORDS) + list(LETTERS) + ["##" + c for c in LETTERS]
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=specials[1]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    used = {t for t in specials if t in single or t in pair}
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in sorted(used)])
    tok.decoder = decoders.WordPiece()
    return tok


def _fast(kind: str) -> Any:
    from transformers import BertTokenizer, PreTrainedTokenizerFast

    if kind.startswith("bert"):
        tok = _tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS] $A [SEP]",
                         "[CLS] $A [SEP] $B:1 [SEP]:1", lowercase=True)
        return BertTokenizer(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                 cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    if kind.startswith("xlmr"):
        tok = _tokenizer(["<s>", "<unk>", "</s>", "<pad>", "<mask>"], "<s> $A </s>",
                         "<s> $A </s> </s> $B </s>", lowercase=False)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>", pad_token="<pad>", cls_token="<s>",
                                       sep_token="</s>", mask_token="<mask>")
    tok = _tokenizer(["<|endoftext|>", "<unk>"], "$A <|endoftext|>", "$A $B <|endoftext|>",
                     lowercase=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>")


def _labelled(cfg: Any) -> dict[str, Any]:
    """The config's fields for a one-label classifier (its default label maps have two)."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
    return {**d, "num_labels": 1}


def _model(kind: str, vocab_size: int, pad_id: int, size: dict[str, Any]) -> Any:
    import transformers as tf

    if kind.startswith("bert"):
        cfg = tf.BertConfig(vocab_size=vocab_size, max_position_embeddings=128,
                            initializer_range=0.2, pad_token_id=pad_id, **size)
        return (tf.BertForSequenceClassification(tf.BertConfig(**_labelled(cfg)))
                if kind.endswith("-ce") else tf.BertModel(cfg))
    if kind.startswith("xlmr"):
        xcfg = tf.XLMRobertaConfig(vocab_size=vocab_size, max_position_embeddings=130,
                                  initializer_range=0.2, pad_token_id=pad_id,
                                  bos_token_id=0, eos_token_id=2, type_vocab_size=1, **size)
        if kind.endswith("-ce"):
            return tf.XLMRobertaForSequenceClassification(
                tf.XLMRobertaConfig(**_labelled(xcfg)))
        return tf.XLMRobertaModel(xcfg)
    qcfg = tf.Qwen3Config(vocab_size=vocab_size, num_key_value_heads=2,
                         head_dim=size["hidden_size"] // size["num_attention_heads"],
                         max_position_embeddings=256, initializer_range=0.2,
                         pad_token_id=pad_id, eos_token_id=pad_id, **size)
    return tf.Qwen3Model(qcfg)


def build_pooling_model(out_dir: str | Path, kind: str, seed: int = 0,
                        max_seq_length: int = 64, matryoshka: list[int] | None = None,
                        size: dict[str, Any] | None = None) -> Path:
    """A sentence-transformers folder of `kind` (one of KINDS) at `out_dir`; `size`: the
    transformer's shape (default SIZE, tiny)."""
    size = size or SIZE
    import torch

    out = Path(out_dir)
    hf_dir = out / "hf"
    torch.manual_seed(seed)
    tok = _fast(kind)
    model = _model(kind, len(tok), tok.pad_token_id, size)
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    if kind.endswith("-ce"):
        from sentence_transformers import CrossEncoder

        CrossEncoder(str(hf_dir), device="cpu", max_length=max_seq_length).save(str(out))
    else:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import (
            Normalize,
            Pooling,
            Transformer,
        )

        mode = {"bert": "mean", "xlmr": "cls", "qwen3": "lasttoken"}[kind]
        modules = [Transformer(str(hf_dir), max_seq_length=max_seq_length),
                   Pooling(size["hidden_size"], mode), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(out))
    if matryoshka:
        path = out / "config.json"
        config = json.loads(path.read_text())
        config["matryoshka_dimensions"] = matryoshka
        path.write_text(json.dumps(config, indent=2))
    return out
