"""Test helpers: tiny random HF checkpoints, a paged-cache greedy driver, HF references.

Reusable from any test:

    from tests.gpu_worker.model_utils import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=1, tie_word_embeddings=True)

The checkpoint directory holds config.json, generation_config.json, model.safetensors (or shards
plus model.safetensors.index.json) and, by default, a tiny byte-level BPE tokenizer
(tokenizer.json + tokenizer_config.json; BOS "<s>"=1 is prepended, EOS "</s>"=2, "<unk>"=0),
so it is a complete model directory for the serving stack. Nothing is downloaded.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.models.decoder import CausalLM

ARCH_ALIASES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
FIRST_NORMAL_ID = 3  # ids below are special tokens

# Defaults shared by every architecture: small enough for fast CPU tests, with GQA on.
_BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=UNK_ID,
    tie_word_embeddings=False,
)


def _hf_classes(arch: str) -> tuple[type, type]:
    import transformers

    name = ARCH_ALIASES.get(arch.lower(), arch)
    if name not in ARCH_ALIASES.values():
        raise ValueError(f"unknown test architecture {arch!r}")
    family = name.removesuffix("ForCausalLM")
    return getattr(transformers, f"{family}Config"), getattr(transformers, name)


def make_tiny_config(arch: str, **overrides: Any) -> Any:
    """An HF config object for ``arch`` ("llama" or "LlamaForCausalLM", ...), tiny by default.

    Overrides are config kwargs, e.g. ``rope_scaling={"rope_type": "linear", "factor": 2.0}``,
    ``head_dim=32``, ``sliding_window=48`` (mistral), ``attention_bias=True``.
    """
    config_cls, _ = _hf_classes(arch)
    kwargs = dict(_BASE_CONFIG)
    name = ARCH_ALIASES.get(arch.lower(), arch)
    if name == "MistralForCausalLM":
        kwargs["sliding_window"] = None  # HF default 4096; tests opt in explicitly
    kwargs.update(overrides)
    if name == "Qwen3ForCausalLM" and "head_dim" not in overrides:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if "sliding_window" in overrides and name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen only slides on layers >= max_window_layers (HF default 28): opt all layers in.
        kwargs.setdefault("use_sliding_window", overrides["sliding_window"] is not None)
        kwargs.setdefault("max_window_layers", 0)
    return config_cls(**kwargs)


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """Re-initialise with large weights so greedy decoding is diverse and logits well separated.

    HF's std-0.02 init makes tiny models repeat one token, which would make parity tests blind.
    Embeddings/lm_head ~ N(0, 1); linears ~ N(0, 2*scale/sqrt(fan_in)); norms ~ 1 + N(0, 0.1);
    biases ~ N(0, 0.2).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:  # RMSNorm weights
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            std = 2.0 * scale / math.sqrt(p.shape[1])
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_copier_checkpoint(tmp_dir: str | os.PathLike[str], *, tokenizer: bool = True) -> str:
    """A tiny llama whose attention and MLP outputs are scaled down: nearly a bigram model,
    so greedy output follows chains that a copy-heavy prompt already holds (speculative
    drafts get accepted), while the context still moves the logits (the KV of accepted
    drafts matters)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_dir, "llama", tokenizer=tokenizer, seed=5)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * 0.05
    save_file(weights, file, metadata={"format": "pt"})
    return path


def make_tiny_checkpoint(
    tmp_dir: str | os.PathLike[str],
    arch: str,
    *,
    seed: int = 0,
    init_scale: float = 1.0,
    max_shard_size: int | str | None = None,
    save_dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    **overrides: Any,
) -> str:
    """Build, randomise and save a tiny HF checkpoint; return its directory (inside tmp_dir).

    ``overrides`` go to the HF config (see make_tiny_config). ``max_shard_size`` (e.g. 200_000
    bytes) forces a sharded save with an index. ``tokenizer`` adds a byte-level BPE tokenizer
    trained offline on a synthetic corpus (needs vocab_size >= 300).
    """
    config = make_tiny_config(arch, **overrides)
    _, model_cls = _hf_classes(arch)
    torch.manual_seed(seed)
    model = model_cls(config)
    randomize_weights(model, seed=seed, scale=init_scale)
    model = model.to(save_dtype).eval()
    path = tempfile.mkdtemp(prefix=f"tiny-{arch.lower()}-", dir=os.fspath(tmp_dir))
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    if tokenizer and config.vocab_size >= 300:
        save_tiny_tokenizer(path, config.vocab_size)
    return path


_WORDS = (
    "the quick brown fox jumps over lazy dog serving engine token batch cache block prefill "
    "decode stream request model layer attention rotary head value key query sample greedy "
    "tandem scheduler worker ring shared memory latency throughput hello world python tensor "
    "ünïcödé 日本語 emoji 🙂 numbers 0123456789 punctuation , . ; : ! ? ( ) [ ] { } - _ / \\"
).split()


def save_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (fewer if merges run out) and save
    it as a fast tokenizer next to the model. Deterministic for a given vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1234)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 30))) for _ in range(3000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<unk>",
    )
    fast.save_pretrained(path)


# ---------------------------------------------------------------------------------------------
# Paged greedy driver: exercises the model exactly as the serving loop would.
# ---------------------------------------------------------------------------------------------


@dataclass
class PagedSeq:
    tokens: list[int]  # full history: prompt + generated
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    prompt_len: int = 0
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class PagedDriver:
    """Owns a paged KV cache for a model and runs prefill/decode forwards with greedy sampling.

    Blocks are handed out from a shuffled free list so paging bugs cannot hide behind contiguous
    ids; block tables are padded with -1.
    """

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int = 256,
        block_size: int = 16,
        seed: int = 0,
        max_seq_len_slack: int = 0,
    ) -> None:
        from tandem_serve.gpu_worker.attention.kv_cache import allocate_kv_cache

        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = model.device
        self.kv_caches = allocate_kv_cache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            model.dtype, self.device,
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.slack = max_seq_len_slack
        self.eos_ids = set(cfg.eos_token_ids)

    def new_seq(self, prompt: list[int], shared_blocks: list[int] | None = None,
                num_cached: int = 0) -> PagedSeq:
        """A sequence; with ``shared_blocks`` its first blocks are another sequence's (prefix
        caching) and ``num_cached`` prompt tokens are already in them."""
        seq = PagedSeq(tokens=list(prompt), prompt_len=len(prompt))
        if shared_blocks:
            assert num_cached <= len(shared_blocks) * self.block_size
            seq.blocks = list(shared_blocks)
            seq.num_cached = num_cached
        return seq

    def _ensure_blocks(self, seq: PagedSeq, n_tokens: int) -> None:
        need = -(-n_tokens // self.block_size)
        while len(seq.blocks) < need:
            seq.blocks.append(self.free.pop())

    def _block_tables(self, seqs: Sequence[PagedSeq | None]) -> torch.Tensor:
        width = max([len(s.blocks) for s in seqs if s is not None] + [1]) + 1
        rows = [(s.blocks if s is not None else []) for s in seqs]
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)

    def _slot(self, seq: PagedSeq, pos: int) -> int:
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.no_grad()
    def prefill(self, items: list[tuple[PagedSeq, int]]) -> torch.Tensor:
        """One forward over the next ``n`` uncached tokens of each sequence (flattened, no
        padding). Returns float32 logits of each sequence's last token in this forward."""
        from tandem_serve.gpu_worker.attention.base import AttentionMetadata

        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        for seq, n in items:
            start = seq.num_cached
            assert 0 < n and start + n <= len(seq.tokens)
            self._ensure_blocks(seq, start + n)
            for p in range(start, start + n):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(self._slot(seq, p))
            q_lens.append(n)
            seq_lens.append(start + n)
            seq.num_cached = start + n
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._block_tables([s for s, _ in items]).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            query_lens=q_lens,
            max_seq_len=max(seq_lens) + self.slack,
            is_decode=False,
            prefill_seq_lens=seq_lens,  # host-known, as the runner passes them: no sync
        )
        history_lens = None
        if self.model.uses_history_lens:  # LongRoPE: each token's request's history length
            history_lens = torch.tensor([len(s.tokens) for s, n in items for _ in range(n)],
                                        dtype=torch.int64, device=dev)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
            None,
            history_lens,
        )
        last = torch.tensor([q - 1 for q in qsl[1:]], device=dev)
        return self.model.compute_logits(hidden[last])

    @torch.no_grad()
    def decode(self, seqs: Sequence[PagedSeq | None]) -> torch.Tensor:
        """One decode step: feeds each sequence's last token (its K/V not cached yet). ``None``
        entries and finished sequences are masked rows (slot -1). Returns logits [S, V]."""
        from tandem_serve.gpu_worker.attention.base import AttentionMetadata

        ids, pos, slots, seq_lens = [], [], [], []
        table_rows: list[PagedSeq | None] = []
        for seq in seqs:
            if seq is None or seq.done:
                ids.append(0)
                pos.append(0)
                slots.append(-1)
                seq_lens.append(0 if seq is None else seq.num_cached)
                table_rows.append(seq)
                continue
            p = len(seq.tokens) - 1
            assert seq.num_cached == p, "decode expects exactly one uncached token"
            self._ensure_blocks(seq, p + 1)
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(self._slot(seq, p))
            seq_lens.append(p + 1)
            seq.num_cached = p + 1
            table_rows.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._block_tables(table_rows).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=None,
            query_lens=None,
            max_seq_len=max(seq_lens) + self.slack,
            is_decode=True,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
        )
        return self.model.compute_logits(hidden)

    def append_greedy(self, seqs: Sequence[PagedSeq | None], logits: torch.Tensor,
                      max_new_tokens: int) -> None:
        """Append argmax tokens to the live sequences; mark EOS / length finishes done."""
        toks = logits.argmax(-1).tolist()
        for seq, tok in zip(seqs, toks, strict=True):
            if seq is None or seq.done:
                continue
            seq.tokens.append(tok)
            if tok in self.eos_ids or len(seq.generated) >= max_new_tokens:
                seq.done = True

    def generate(self, seqs: list[PagedSeq], max_new_tokens: int,
                 extra_masked_rows: int = 0) -> list[list[int]]:
        """Prefill all sequences in ONE forward, then greedy-decode them as a batch (finished
        ones stay in the batch as masked rows). Returns each sequence's generated ids."""
        logits = self.prefill([(s, len(s.tokens) - s.num_cached) for s in seqs])
        self.append_greedy(list(seqs), logits, max_new_tokens)
        return self.decode_until_done(seqs, max_new_tokens, extra_masked_rows)

    def decode_until_done(self, seqs: list[PagedSeq], max_new_tokens: int,
                          extra_masked_rows: int = 0) -> list[list[int]]:
        batch: list[PagedSeq | None] = list(seqs)
        # Masked padding rows spread through the batch, as a padded device batch would have.
        for i in range(extra_masked_rows):
            batch.insert((i * 3) % (len(batch) + 1), None)
        while not all(s.done for s in seqs):
            logits = self.decode(batch)
            self.append_greedy(batch, logits, max_new_tokens)
        return [s.generated for s in seqs]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(FIRST_NORMAL_ID, vocab_size, (n,), generator=g).tolist() for n in lengths
    ]


class HFReference:
    """HF ``generate(do_sample=False)`` on one prompt at a time (no padding), float32."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.eval()  # type: ignore[no-untyped-call]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], dtype=torch.int64)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
        new_ids: list[int] = out[0, len(prompt) :].tolist()
        return new_ids
