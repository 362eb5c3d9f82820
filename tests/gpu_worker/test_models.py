"""Our decoder over the paged cache against HF generate (greedy, float32), plus loading."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem_serve.gpu_worker.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from tandem_serve.gpu_worker.models.decoder import CausalLM
from tandem_serve.gpu_worker.models.layers import rope_inv_freq
from tandem_serve.gpu_worker.models.loader import load_model
from tests.gpu_worker.model_utils import (
    HFReference,
    PagedDriver,
    make_tiny_checkpoint,
    random_prompts,
)

CPU = torch.device("cpu")
NEW_TOKENS = 30
PROMPT_LENGTHS = [1, 7, 33, 128, 300, 64]

# name -> (arch, make_tiny_checkpoint kwargs). Covers every architecture, GQA ratios 2/4/1/4,
# tied and untied heads, llama3 / linear RoPE, biases, an explicit head_dim, sliding windows
# and a sharded save.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa2-bias-sharded": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, max_shard_size=150_000),
    ),
    "llama-mqa-tied-llama3": (
        "llama",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=50000.0,
        ),
    ),
    "mistral-mha-linear": (
        "mistral",
        dict(
            hidden_size=128,
            num_attention_heads=8,
            num_key_value_heads=8,
            rope_scaling={"rope_type": "linear", "factor": 2.5},
        ),
    ),
    "mistral-sliding": ("mistral", dict(sliding_window=40, num_hidden_layers=3)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True, seed=1)),
    # layer 0 full attention, layers 1-2 a 24-token window: two masks in one forward
    "qwen2-mixed-windows": (
        "qwen2", dict(sliding_window=24, max_window_layers=1, num_hidden_layers=3, seed=3)
    ),
    "qwen3-qknorm-headdim": (
        "qwen3",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, seed=2),
    ),
}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


_cache: dict[str, str] = {}


def checkpoint(root: Path, name: str) -> str:
    if name not in _cache:
        arch, kwargs = CONFIGS[name]
        _cache[name] = make_tiny_checkpoint(root, arch, **kwargs)
    return _cache[name]


_refs: dict[str, HFReference] = {}


def hf_greedy(path: str, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    if path not in _refs:
        _refs[path] = HFReference(path)
    return _refs[path].greedy(prompt, n)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity_batched_prefill_then_decode(ckpt_root: Path, name: str) -> None:
    path = checkpoint(ckpt_root, name)
    model = load_model(path, torch.float32, CPU)
    assert model.config.architecture in SUPPORTED_ARCHITECTURES
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=len(name))
    driver = PagedDriver(model, num_blocks=200, block_size=16, seed=3, max_seq_len_slack=5)
    seqs = [driver.new_seq(p) for p in prompts]
    ours = driver.generate(seqs, NEW_TOKENS, extra_masked_rows=3)
    expected = [hf_greedy(path, p) for p in prompts]
    for prompt, got, want in zip(prompts, ours, expected, strict=True):
        assert got == want, f"prompt len {len(prompt)}"
    # The parity above only means something if the model's output varies.
    assert all(len(set(w)) >= 10 for w in expected if len(w) == NEW_TOKENS)


def test_greedy_parity_plain_linear_path(
    ckpt_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The F.linear path (what CUDA and half precision use) with oneDNN packing off."""
    from tandem_serve.gpu_worker.models import layers

    monkeypatch.setattr(layers, "_ONEDNN_OK", False)
    path = checkpoint(ckpt_root, "qwen3-qknorm-headdim")
    model = load_model(path, torch.float32, CPU)
    assert model._packed_lm_head is None
    prompts = random_prompts([5, 77, 200], model.config.vocab_size, seed=17)
    driver = PagedDriver(model, num_blocks=64, block_size=8, seed=4)
    assert driver.generate([driver.new_seq(p) for p in prompts], NEW_TOKENS) == [
        hf_greedy(path, p) for p in prompts
    ]


def test_chunked_prefill(ckpt_root: Path) -> None:
    path = checkpoint(ckpt_root, "llama-gqa2-bias-sharded")
    model = load_model(path, torch.float32, CPU)
    long_prompt, short_prompt, other = random_prompts([200, 50, 90], 512, seed=11)
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=5)
    a = driver.new_seq(long_prompt)
    b = driver.new_seq(short_prompt)
    c = driver.new_seq(other)
    # Chunks not aligned to blocks; a whole prompt and other chunks share the forwards.
    logits = driver.prefill([(a, 70), (b, 50)])
    driver.append_greedy([None, b], logits, NEW_TOKENS)  # a's row is mid-prompt: no sample
    driver.prefill([(c, 45), (a, 70)])
    logits = driver.prefill([(a, 60), (c, 45)])
    driver.append_greedy([a, c], logits, NEW_TOKENS)
    outs = driver.decode_until_done([a, b, c], NEW_TOKENS, extra_masked_rows=1)
    assert outs == [hf_greedy(path, p) for p in (long_prompt, short_prompt, other)]


def test_prefix_reuse(ckpt_root: Path) -> None:
    path = checkpoint(ckpt_root, "qwen3-qknorm-headdim")
    model = load_model(path, torch.float32, CPU)
    base, tail = random_prompts([100, 37], model.config.vocab_size, seed=21)
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=9)
    first = driver.new_seq(base)
    assert driver.generate([first], NEW_TOKENS) == [hf_greedy(path, base)]
    # Second request shares the first 4 full blocks (64 tokens) of the first one's prompt.
    shared = first.blocks[:4]
    snapshot = [(k[shared].clone(), v[shared].clone()) for k, v in driver.kv_caches]
    prompt = base[:64] + tail
    second = driver.new_seq(prompt, shared_blocks=shared, num_cached=64)
    fresh = driver.new_seq(tail)  # batched with an unrelated fresh prompt
    outs = driver.generate([second, fresh], NEW_TOKENS)
    assert outs == [hf_greedy(path, prompt), hf_greedy(path, tail)]
    for (k, v), (k0, v0) in zip(driver.kv_caches, snapshot, strict=True):
        assert torch.equal(k[shared], k0) and torch.equal(v[shared], v0)


def test_decode_has_no_host_sync(ckpt_root: Path) -> None:
    guard = pytest.importorskip("tests.gpu_worker.sync_guard")
    path = checkpoint(ckpt_root, "mistral-sliding")
    model = load_model(path, torch.float32, CPU)
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=1)
    seqs = [driver.new_seq(p) for p in random_prompts([5, 60], 512, seed=4)]
    driver.append_greedy(seqs, driver.prefill([(s, len(s.tokens)) for s in seqs]), 10)
    orig = model.forward

    def guarded(*args: Any) -> torch.Tensor:
        with guard.forbid_host_sync():
            return orig(*args)

    setattr(model, "forward", guarded)  # noqa: B010 - instance override, mypy-clean
    logits = driver.decode([seqs[0], None, seqs[1]])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_and_decode(ckpt_root: Path, dtype: torch.dtype) -> None:
    path = checkpoint(ckpt_root, "qwen2-bias-tied")
    model = load_model(path, dtype, CPU)
    assert model.dtype == dtype
    assert all(p.dtype == dtype for p in model.parameters())
    driver = PagedDriver(model, num_blocks=64, block_size=16)
    assert driver.kv_caches[0][0].dtype == dtype
    seqs = [driver.new_seq(p) for p in random_prompts([3, 40, 17], 512, seed=8)]
    logits = driver.prefill([(s, len(s.tokens)) for s in seqs])
    assert logits.dtype == torch.float32 and logits.shape == (3, 512)
    assert torch.isfinite(logits).all()
    driver.append_greedy(seqs, logits, 8)
    for _ in range(7):
        logits = driver.decode([seqs[0], None, seqs[1], seqs[2]])
        assert torch.isfinite(logits).all()
        driver.append_greedy([seqs[0], None, seqs[1], seqs[2]], logits, 8)
    assert all(len(s.generated) == 8 or s.done for s in seqs)


# ---- loading and config parsing ---------------------------------------------------------


def _copy(path: str, dst: Path) -> Path:
    out = dst / "copy"
    shutil.copytree(path, out)
    return out


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_is_rejected(ckpt_root: Path, tmp_path: Path) -> None:
    p = _copy(checkpoint(ckpt_root, "qwen2-bias-tied"), tmp_path)
    _edit_config(p, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(p), torch.float32, CPU)


def test_missing_weight_is_rejected(ckpt_root: Path, tmp_path: Path) -> None:
    p = _copy(checkpoint(ckpt_root, "qwen3-qknorm-headdim"), tmp_path)
    tensors = load_file(str(p / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(p / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(str(p), torch.float32, CPU)


def test_missing_shard_weight_and_untied_head(ckpt_root: Path, tmp_path: Path) -> None:
    p = _copy(checkpoint(ckpt_root, "llama-gqa2-bias-sharded"), tmp_path)
    index = json.loads((p / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "checkpoint should be sharded"
    del index["weight_map"]["lm_head.weight"]
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(str(p), torch.float32, CPU)


def test_wrong_shape_is_rejected(ckpt_root: Path, tmp_path: Path) -> None:
    p = _copy(checkpoint(ckpt_root, "qwen2-bias-tied"), tmp_path)
    tensors = load_file(str(p / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0] * 2, tensors[name].shape[1])
    save_file(tensors, str(p / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(str(p), torch.float32, CPU)


def test_harmless_extras_are_ignored(ckpt_root: Path, tmp_path: Path) -> None:
    p = _copy(checkpoint(ckpt_root, "qwen2-bias-tied"), tmp_path)
    tensors = load_file(str(p / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() * 3  # tied: unused
    save_file(tensors, str(p / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(str(p), torch.float32, CPU)
    assert model.lm_head is model.embed_tokens


def test_unsupported_rope_type_is_rejected(ckpt_root: Path, tmp_path: Path) -> None:
    p = _copy(checkpoint(ckpt_root, "qwen2-bias-tied"), tmp_path)
    _edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="yarn"):
        load_model(str(p), torch.float32, CPU)


def _base_cfg(**kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
    )
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize(
    "cfg",
    [
        # transformers >= 5 layout
        _base_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1234.0}),
        _base_cfg(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}),
        _base_cfg(
            rope_parameters={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                "rope_theta": 5e5,
            }
        ),
        # legacy layouts: rope_scaling with `type` / `rope_type`, rope_theta at the top level
        _base_cfg(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}),
        _base_cfg(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
            },
        ),
        _base_cfg(rope_theta=77.0),
        _base_cfg(head_dim=32),
    ],
)
def test_rope_config_forms_match_transformers(cfg: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    args = ModelArgs.from_hf_config(json.loads(json.dumps(cfg)))
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf = LlamaRotaryEmbedding(hf_cfg)
    assert hf.attention_scaling == 1.0
    assert args.head_dim == hf.inv_freq.shape[0] * 2
    torch.testing.assert_close(rope_inv_freq(args), hf.inv_freq, rtol=0, atol=0)


def test_model_args_from_config(ckpt_root: Path) -> None:
    path = checkpoint(ckpt_root, "qwen3-qknorm-headdim")
    model = load_model(path, torch.float32, CPU)
    a = model.config
    assert isinstance(model, CausalLM)
    assert (a.architecture, a.num_heads, a.num_kv_heads, a.head_dim) == (
        "Qwen3ForCausalLM", 8, 2, 32,
    )
    assert a.qk_norm and not a.qkv_bias and not a.tie_word_embeddings
    assert a.bos_token_id == 1 and a.eos_token_ids == (2,) and a.eos_token_id == 2
    assert a.num_layers == 2 and a.vocab_size == 512 and a.hidden_size == 64
    sliding = ModelArgs.from_hf_config(
        json.loads(Path(checkpoint(ckpt_root, "mistral-sliding"), "config.json").read_text())
    )
    assert sliding.sliding_windows == (40, 40, 40)
    # generation_config.json wins for EOS, as in HF generate (e.g. Llama-3 instruct lists).
    args = ModelArgs.from_hf_config(_base_cfg(eos_token_id=2), {"eos_token_id": [2, 7]})
    assert args.eos_token_ids == (2, 7)
    qwen = ModelArgs.from_hf_config(
        _base_cfg(
            architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16,
            max_window_layers=1,
        )
    )
    assert qwen.sliding_windows == (None, 16) and qwen.qkv_bias and not qwen.o_bias


def test_checkpoint_helper_tokenizer(ckpt_root: Path) -> None:
    from transformers import AutoTokenizer

    path = checkpoint(ckpt_root, "qwen2-bias-tied")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("hello world 🙂")["input_ids"]
    assert ids[0] == 1 and max(ids) < 512 and tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == "hello world 🙂"
    assert os.path.exists(os.path.join(path, "generation_config.json"))


@pytest.mark.gpu
def test_cuda_greedy_parity_and_no_sync(ckpt_root: Path) -> None:
    guard = pytest.importorskip("tests.gpu_worker.sync_guard")
    path = checkpoint(ckpt_root, "llama-mqa-tied-llama3")
    model = load_model(path, torch.float32, torch.device("cuda"))
    assert model.device.type == "cuda"
    prompts = random_prompts([1, 50, 300], 512, seed=99)
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=2)
    seqs = [driver.new_seq(p) for p in prompts]
    assert driver.generate(seqs, NEW_TOKENS, extra_masked_rows=2) == [
        hf_greedy(path, p) for p in prompts
    ]
    orig = model.forward

    def guarded(*args: Any) -> torch.Tensor:
        with guard.forbid_host_sync():
            return orig(*args)

    setattr(model, "forward", guarded)  # noqa: B010 - instance override, mypy-clean
    live = [driver.new_seq(p) for p in random_prompts([20, 70], 512, seed=5)]
    driver.append_greedy(live, driver.prefill([(s, len(s.tokens)) for s in live]), 5)
    assert torch.isfinite(driver.decode([live[0], None, live[1]])).all()
    bf16 = load_model(path, torch.bfloat16, torch.device("cuda"))
    d2 = PagedDriver(bf16, num_blocks=64, block_size=16)
    s2 = [d2.new_seq(p) for p in prompts]
    assert all(len(o) > 0 for o in d2.generate(s2, 5))
