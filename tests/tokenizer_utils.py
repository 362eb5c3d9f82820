"""Test helpers: build the two tokenizer families Tandem must serve into a model folder.

No hub access here, so both are made locally:

* SentencePiece with byte fallback (Llama-2 / Mistral style): Mistral's 32000-token v1
  `tokenizer.model`, which `mistral_common` ships, converted by `transformers`.
* Byte-level BPE (GPT-2 / Llama-3 / Qwen style): trained with `tokenizers` on a generated
  multilingual text, with Llama-3-like special tokens and a BOS template.

Each builder writes tokenizer.json, tokenizer_config.json and generation_config.json into a
folder, so `AutoTokenizer.from_pretrained(folder)` and
`tokenization.tokenizer.Tokenizer.from_dir(folder)`
both load it. `sentencepiece_dir()` / `byte_level_bpe_dir()` build once per process and cache.
"""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

SP_VOCAB_SIZE = 32000
BPE_VOCAB_SIZE = 3000
BPE_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"]
# An added token that is not special: decode keeps it even with skip_special_tokens=True.
BPE_PLAIN_ADDED_TOKEN = "<think>"

# Texts that stress detokenization: multi-byte scripts, grapheme clusters built from several
# code points (ZWJ emoji, skin tones, combining accents), whitespace runs, special tokens
# in the middle. "{eos}"/"{bos}" are replaced by the family's special token strings.
MULTILINGUAL_CORPUS: list[str] = [
    "Hello world! This is a plain English sentence, with punctuation.",
    " leading space and trailing space ",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキスト：東京は大きな都市です。カタカナとひらがな。",
    "မြန်မာဘာသာစကား မင်္ဂလာပါ",
    "مرحبا بالعالم، هذه جملة باللغة العربية.",
    "Family: 👩‍👩‍👧‍👦 thumbs: 👍🏽 👍🏿 flags: 🇫🇷🇯🇵 heart: ❤️‍🔥",
    "Combining: e\u0301 a\u0300 n\u0303 o\u0308 — café naïve",
    "tabs\there\t\tand\nnew\nlines\n\n\nend",
    "runs of     spaces      and  double  spaces",
    "code:\n    def f(x):\n        return x * 2  # comment\n",
    "mixed 中文 English العربية 日本語 😀 ok",
    "before{eos}after{bos} more text",
    "{bos}start with bos and end with eos{eos}",
    "Ünïcödé çhàràctérs ñ ß ø å æ œ",
    "Numbers 1234567890 and symbols !@#$%^&*()_+-=[]{}|;:',.<>/?`~",
    "🙂🙃😉😊😇🥰😍🤩😘😗☺️😚😙",
    "Ελληνικά κείμενα και русский текст, עברית",
    "ハングル 한국어 문장입니다. ไทย ภาษาไทย",
    "\n\n\n",
    "a",
    "",
]

_WORDS_BY_SCRIPT: list[list[str]] = [
    "the of and to in is that for it as with was on be by this are from at or an".split(),
    "hello world model token server request stream text output input space line".split(),
    "你好 世界 今天 天气 我们 公园 散步 中文 文本 模型 服务 请求 输出 输入".split(),
    "日本 東京 都市 テキスト カタカナ ひらがな です ます 大きな 言語".split(),
    "မြန်မာ ဘာသာ စကား မင်္ဂလာပါ ကျေးဇူး".split(),
    "مرحبا العالم هذه جملة اللغة العربية كتاب مدينة".split(),
    "Ελληνικά κείμενα русский текст עברית 한국어 문장 ภาษาไทย".split(),
    "😀 👍 👍🏽 👩‍👩‍👧‍👦 ❤️ 🇫🇷 é café naïve ß".split(),
    ["\n", "\t", "  ", "    ", ".", ",", "!", "?", ":", "(", ")", "def", "return", "x"],
]
# Alphabets for made-up words, so the trainer finds enough distinct merges for its vocab size.
_ALPHABETS: list[str] = [
    "etaoinshrdlucmfwypvbgkjqxz",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "あいうえおかきくけこさしすせそたちつてとなにぬねのアイウエオカキクケコ",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "абвгдежзийклмнопрстуфхцчшщыэюя",
    "αβγδεζηθικλμνξοπρστυφχψω",
]


def corpus_for(bos: str, eos: str) -> list[str]:
    """The corpus with the family's BOS/EOS strings put in."""
    return [t.replace("{bos}", bos).replace("{eos}", eos) for t in MULTILINGUAL_CORPUS]


def generated_text(n_lines: int = 3000, seed: int = 0) -> Iterator[str]:
    """Deterministic multilingual training text, so the trained BPE merges cover every script."""
    rng = random.Random(seed)
    yield from MULTILINGUAL_CORPUS
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 24)):
            if rng.random() < 0.5:
                words.append(rng.choice(rng.choice(_WORDS_BY_SCRIPT)))
            else:
                # Skewed letter choice: frequent pairs exist, as in real text.
                alphabet = rng.choice(_ALPHABETS)
                k = len(alphabet)
                word = "".join(alphabet[min(int(rng.expovariate(6 / k)), k - 1)]
                               for _ in range(rng.randint(1, 7)))
                words.append(word)
        yield " ".join(words)


def build_sentencepiece_tokenizer(model_dir: str | Path) -> Path:
    """Llama-2/Mistral style SentencePiece tokenizer (BPE with byte fallback) in `model_dir`."""
    import importlib

    import mistral_common
    from transformers import LlamaTokenizerFast

    # The module itself: once something has read `transformers.convert_slow_tokenizer`, the
    # package's lazy attribute of that name is the function, which `import ... as` returns.
    convert_slow = importlib.import_module("transformers.convert_slow_tokenizer")

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    spm = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    shutil.copyfile(spm, out / "tokenizer.model")
    # What a Llama-2 checkpoint ships. add_bos_token shapes the post-processor the conversion
    # writes into tokenizer.json; once that file exists, transformers 5 takes BOS from it alone.
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # The .model conversion only needs protobuf, but transformers insists on the sentencepiece
    # package being installed (it is not here), so the check is skipped for this one call.
    with mock.patch.object(convert_slow, "requires_backends", lambda *a, **k: None):
        tok = LlamaTokenizerFast.from_pretrained(str(out))
    if len(tok) != SP_VOCAB_SIZE or tok.convert_tokens_to_ids("<0x0A>") != 13:
        raise RuntimeError(f"unexpected SentencePiece conversion: {len(tok)} tokens")
    tok.save_pretrained(str(out))
    (out / "tokenizer.model").unlink()  # make sure every loader reads tokenizer.json
    _write_generation_config(out, bos=1, eos=2)
    return out


def build_byte_level_bpe_tokenizer(model_dir: str | Path) -> Path:
    """GPT-2/Llama-3/Qwen style byte-level BPE, trained here, saved like a Llama-3 checkpoint."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(generated_text(), trainer=trainer)
    raw.add_tokens([AddedToken(BPE_PLAIN_ADDED_TOKEN, special=False, normalized=False)])
    bos, eos = BPE_SPECIAL_TOKENS[0], BPE_SPECIAL_TOKENS[1]
    bos_id = raw.token_to_id(bos)
    # Llama-3 puts BOS in the tokenizer.json post-processor, not in tokenizer_config.json.
    raw.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=BPE_SPECIAL_TOKENS[3],
        clean_up_tokenization_spaces=True, model_max_length=8192,
    )
    tok.save_pretrained(str(out))
    eos_ids = [_token_id(raw, eos), _token_id(raw, BPE_SPECIAL_TOKENS[2])]
    _write_generation_config(out, bos=_token_id(raw, bos), eos=eos_ids)
    return out


def build_wordpiece_tokenizer(model_dir: str | Path) -> Path:
    """A BERT-style WordPiece tokenizer with clean_up_tokenization_spaces on: neither family's
    decoder, so the detokenizer takes its generic window path and its clean-up stage."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import WordPieceTrainer
    from transformers import PreTrainedTokenizerFast

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # BERT default
    trainer = WordPieceTrainer(
        vocab_size=2000, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"], show_progress=False
    )
    raw.train_from_iterator(generated_text(1500), trainer=trainer)
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, unk_token="[UNK]", bos_token="[CLS]", eos_token="[SEP]",
        pad_token="[PAD]", clean_up_tokenization_spaces=True,
    )
    tok.save_pretrained(str(out))
    _write_generation_config(out, bos=_token_id(raw, "[CLS]"), eos=_token_id(raw, "[SEP]"))
    return out


def _token_id(raw: Any, token: str) -> int:
    token_id = raw.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"{token!r} missing from the built tokenizer")
    return int(token_id)


def _write_generation_config(out: Path, bos: int, eos: int | list[int]) -> None:
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2)
    )


def _cached_build(builder: Callable[[Path], Path]) -> Path:
    root = Path(tempfile.mkdtemp(prefix="tandem-tok-"))
    atexit.register(shutil.rmtree, root, True)
    return builder(root / builder.__name__.removeprefix("build_"))


@functools.cache
def sentencepiece_dir() -> Path:
    """A SentencePiece model folder built once per process."""
    return _cached_build(build_sentencepiece_tokenizer)


@functools.cache
def wordpiece_dir() -> Path:
    """A WordPiece model folder built once per process."""
    return _cached_build(build_wordpiece_tokenizer)


@functools.cache
def byte_level_bpe_dir() -> Path:
    """A byte-level BPE model folder built once per process."""
    return _cached_build(build_byte_level_bpe_tokenizer)
