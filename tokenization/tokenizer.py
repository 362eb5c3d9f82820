"""Hugging Face tokenization without torch.

`transformers.AutoTokenizer` imports torch (seconds and hundreds of MB per process), so the
frontend and the postproc workers load a model folder's `tokenizer.json` with the `tokenizers`
library and reproduce what `AutoTokenizer.from_pretrained(dir)` (transformers 5.x) layers on
top of it:

* named special tokens (bos/eos/unk/pad/sep/cls/mask, extra/additional special tokens, other
  `*_token` entries) and `added_tokens_decoder` from tokenizer_config.json (or the legacy
  special_tokens_map.json) are registered the way TokenizersBackend.__init__ does, so encode
  splits on them and `skip_special_tokens` drops exactly the same ids;
* `tokenizer_class: LlamaTokenizer` rebuilds normalizer / pre-tokenizer / decoder from the
  `legacy` and `add_prefix_space` flags, because transformers 5 ignores those parts of a
  SentencePiece-style tokenizer.json for that class;
* `clean_up_tokenization_spaces` applies to decode only for non-BPE models, as in transformers 5;
* `split_special_tokens` is honoured;
* BOS/EOS insertion comes from the tokenizer.json post-processor alone: transformers 5 drops
  `add_bos_token` / `add_eos_token` from tokenizer_config.json whenever a tokenizer.json exists;
* EOS ids come from generation_config.json, else config.json, else the tokenizer's eos token,
  in that order, which is what `generate()` uses.

The HF parity tests in tests/tokenization/test_tokenizer.py are the judge of all of this.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerLoadError(ValueError):
    """The model folder has no usable tokenizer."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_added_token(value: Any, special: bool | None = None) -> AddedToken | None:
    """A config entry (string or serialized AddedToken dict) as an AddedToken."""
    if isinstance(value, AddedToken):
        token = value
    elif isinstance(value, str):
        # transformers turns plain strings into special, non-normalized added tokens
        token = AddedToken(value, special=True, normalized=False)
    elif isinstance(value, dict) and isinstance(value.get("content"), str):
        fields = {k: bool(value[k]) for k in _ADDED_TOKEN_FIELDS if k in value}
        token = AddedToken(value["content"], **fields)
    else:
        return None
    if special is not None and token.special != special:
        state = {k: getattr(token, k) for k in _ADDED_TOKEN_FIELDS}
        state["special"] = special
        token = AddedToken(token.content, **state)
    return token


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def clean_up_tokenization(text: str) -> str:
    # Same replacements, in the same order, as PreTrainedTokenizerBase.clean_up_tokenization.
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


class Tokenizer:
    """A model folder's tokenizer with AutoTokenizer semantics, on `tokenizers` alone."""

    def __init__(
        self,
        raw: RawTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Sequence[int],
        clean_up_tokenization_spaces: bool,
        special_tokens_map: dict[str, str] | None = None,
    ) -> None:
        self._raw = raw
        self.word_cache: bool = _keep_word_cache_only_for_words(raw)
        added = raw.get_added_tokens_decoder()
        max_added = max(added, default=-1)
        self.vocab_size: int = max(raw.get_vocab_size(with_added_tokens=True), max_added + 1)
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.bos_token: str | None = bos_token
        self.bos_token_id: int | None = (
            raw.token_to_id(bos_token) if bos_token is not None else None
        )
        self.eos_token: str | None = eos_token
        self.eos_token_ids: list[int] = list(eos_token_ids)
        if self.eos_token is None and self.eos_token_ids:
            self.eos_token = raw.id_to_token(self.eos_token_ids[0])
        self.clean_up_tokenization_spaces: bool = clean_up_tokenization_spaces
        # The named special tokens (bos_token, eos_token, ...) as HF's `special_tokens_map`,
        # which chat templates see as variables.
        self.special_tokens_map: dict[str, str] = dict(special_tokens_map or {})

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str) -> Tokenizer:
        """Load `model_dir/tokenizer.json` plus the configs AutoTokenizer reads next to it."""
        root = Path(model_dir)
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            hint = ""
            if (root / "tokenizer.model").is_file():
                hint = (
                    " It has a SentencePiece tokenizer.model only: convert it once with "
                    "transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(dir))."
                )
            raise TokenizerLoadError(f"no {TOKENIZER_FILE} in model folder {str(root)!r}.{hint}")
        tok_json_text = tok_file.read_text(encoding="utf-8")
        try:
            raw = RawTokenizer.from_str(tok_json_text)
        except Exception as e:  # the Rust error names the bad field; keep it
            raise TokenizerLoadError(f"cannot load {tok_file}: {e}") from e

        config = _read_json(root / TOKENIZER_CONFIG_FILE)
        model_config = _read_json(root / "config.json")
        generation_config = _read_json(root / "generation_config.json")

        if "additional_special_tokens" in config and "extra_special_tokens" not in config:
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        if "added_tokens_decoder" not in config:
            _merge_legacy_special_tokens_map(config, _read_json(root / SPECIAL_TOKENS_MAP_FILE))

        declared = config.get("tokenizer_class") or model_config.get("tokenizer_class") or ""
        tokenizer_class = str(declared).removesuffix("Fast")
        if tokenizer_class == "LlamaTokenizer" and '"ByteLevel"' not in tok_json_text:
            _rebuild_llama_pipeline(raw, config)

        named = _register_added_tokens(raw, config)
        raw.encode_special_tokens = bool(config.get("split_special_tokens", False))

        bos = named.get("bos_token")
        eos = named.get("eos_token")
        eos_ids = _eos_ids(generation_config, model_config)
        if not eos_ids and eos is not None:
            eos_id = raw.token_to_id(eos)
            eos_ids = [eos_id] if eos_id is not None else []
        model_type = type(raw.model).__name__
        clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            model_type != "BPE"
            or bool(config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
            ))
        )
        return cls(
            raw,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            clean_up_tokenization_spaces=clean_up,
            special_tokens_map={k: v for k, v in named.items() if k in NAMED_SPECIAL_TOKENS},
        )

    # ---- encode / decode -----------------------------------------------------------------

    @property
    def raw(self) -> RawTokenizer:
        """The configured `tokenizers.Tokenizer` (shared; do not mutate)."""
        return self._raw

    def encode(self, text: str, add_special_tokens: bool = True, *,
               release_gil: bool = False) -> list[int]:
        """As `AutoTokenizer(text)["input_ids"]` (special tokens per the post-processor);
        without them as `apply_chat_template` encodes a rendered chat (its template writes
        BOS itself).

        `release_gil`: let the process's other threads run Python meanwhile, for a caller on
        a worker thread.  `tokenizers`' `encode` holds the GIL for the whole call (a thread
        running it stops the event loop just the same); its batch form releases it, and
        costs the same."""
        if release_gil:
            return self._raw.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._raw.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, *, release_gil: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and (start, end) character offsets into `text`, as return_offsets_mapping;
        `release_gil` as for `encode`."""
        enc = (self._raw.encode_batch([text], add_special_tokens=True)[0] if release_gil
               else self._raw.encode(text, add_special_tokens=True))
        return enc.ids, [(int(s), int(e)) for s, e in enc.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """As `AutoTokenizer.decode(ids, skip_special_tokens=...)`."""
        text = self._raw.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = clean_up_tokenization(text)
        return text

    def id_to_token(self, i: int) -> str:
        """The raw token string ("▁Hello", "<0x0A>", "Ġworld"); "" for an unknown id."""
        token = self._raw.id_to_token(i)
        return token if token is not None else ""

    def token_to_id(self, token: str) -> int | None:
        return self._raw.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size


def _merge_legacy_special_tokens_map(config: dict[str, Any], smap: dict[str, Any]) -> None:
    # Older checkpoints keep special tokens in special_tokens_map.json; transformers lets its
    # values win over tokenizer_config.json and merges the extra-token lists.
    for key, value in smap.items():
        if key == "additional_special_tokens":
            key = "extra_special_tokens"
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = {**value, "special": True}
        elif key == "extra_special_tokens" and isinstance(value, list):
            existing = list(config.get("extra_special_tokens") or [])
            for tok in value:
                tok = {**tok, "special": True} if isinstance(tok, dict) else tok
                if tok not in existing:
                    existing.append(tok)
            value = existing
        config[key] = value


def _keep_word_cache_only_for_words(raw: RawTokenizer) -> bool:
    """Turn the BPE model's word cache off when a "word" is the whole text; True if kept.

    `tokenizers` caches the pieces of every word under 256 characters, up to 10,000 of them
    and never evicting. That pays when pre-tokenization splits text into words that recur.
    SentencePiece-style pipelines (Metaspace with split=False, or no pre-tokenizer) leave the
    whole text as one word: every short prompt then became an entry (~8 KB for 180 chars)
    that is hardly ever hit again, and the frontend's RSS grew by about 1 MB a minute at
    4 requests/s until 10,000 distinct prompts had come by.
    """
    model = raw.model
    if not hasattr(model, "_resize_cache"):  # not BPE (no such cache), or an old tokenizers
        return False
    pre = raw.pre_tokenizer
    if pre is not None and len(pre.pre_tokenize_str("a b")) > 1:
        return True
    model._resize_cache(0)
    return False


def _rebuild_llama_pipeline(raw: RawTokenizer, config: dict[str, Any]) -> None:
    # transformers 5's LlamaTokenizer keeps only vocab, merges and post-processor from
    # tokenizer.json and builds the rest itself; older Llama-2 files (Prepend/Replace
    # normalizer, no pre-tokenizer) therefore encode differently unless rebuilt the same way.
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    if add_prefix_space:
        scheme = "first" if not config.get("legacy", False) else "always"
    else:
        scheme = "never"
    raw.normalizer = None
    raw.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    chain: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        chain.append(decoders.Strip(content=" ", left=1))
    raw.decoder = decoders.Sequence(chain)


def _register_added_tokens(raw: RawTokenizer, config: dict[str, Any]) -> dict[str, str]:
    """Add config-declared tokens as TokenizersBackend.__init__ does; named token strings."""
    by_content: dict[str, AddedToken] = {}
    config_added: list[AddedToken] = []
    for _idx, value in sorted(
        (config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])
    ):
        token = _as_added_token(value)
        if token is not None:
            config_added.append(token)
            by_content[token.content] = token

    # Named tokens; a name whose string matches an added_tokens_decoder entry takes that
    # entry's flags, as transformers maps them through its added-tokens table.
    named_values: dict[str, Any] = {}
    for key in NAMED_SPECIAL_TOKENS:
        if config.get(key) is not None:
            named_values[key] = config[key]
    model_specific = config.get("model_specific_special_tokens")
    extra = config.get("extra_special_tokens")
    extra_list: list[Any] = []
    if isinstance(extra, dict):
        model_specific = {**(model_specific or {}), **extra}
    elif isinstance(extra, (list, tuple)):
        extra_list = list(extra)
    for key, value in config.items():
        # transformers treats any other "*_token" string entry (image_token, ...) as named
        if (
            key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS
            and isinstance(value, str)
        ):
            named_values[key] = value
    if isinstance(model_specific, dict):
        named_values.update({k: v for k, v in model_specific.items() if v is not None})

    named: dict[str, str] = {}
    named_tokens: list[AddedToken] = []
    for key, value in named_values.items():
        token = _as_added_token(value)
        if token is None:
            continue
        token = by_content.get(token.content, token)
        named[key] = token.content
        named_tokens.append(token)
    extra_tokens = [t for t in map(_as_added_token, extra_list) if t is not None]

    # Everything declared in the config is re-added (add_tokens keeps identical entries and
    # updates changed ones); named or extra tokens only when the tokenizer lacks them.
    present = {t.content for t in raw.get_added_tokens_decoder().values()}
    present |= {t.content for t in config_added}
    to_add: list[AddedToken] = list(config_added)
    for token in named_tokens + extra_tokens:
        if token.content not in present:
            present.add(token.content)
            to_add.append(token)
    named_contents = set(named.values())
    final: list[AddedToken] = []
    for token in to_add:
        if not token.special and token.content in named_contents:
            token = AddedToken(
                token.content, single_word=token.single_word, lstrip=token.lstrip,
                rstrip=token.rstrip, normalized=token.normalized, special=True,
            )
        final.append(token)
    if final:
        raw.add_tokens(final)
    return named


def _eos_ids(generation_config: dict[str, Any], model_config: dict[str, Any]) -> list[int]:
    for source in (generation_config, model_config, model_config.get("text_config") or {}):
        if isinstance(source, dict) and "eos_token_id" in source:
            ids = _as_id_list(source["eos_token_id"])
            if ids:
                return list(dict.fromkeys(ids))
    return []
