"""quantization_config: the published spellings and transformers 5's are read alike, and
anything not implemented is refused naming the key and its value (torch-free parts)."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.quant.config import (
    AWQ,
    CT_FP8,
    CT_W4A16,
    FP8_BLOCK,
    GPTQ,
    QuantConfig,
    parse,
)
from tandem_serve.gpu_worker.models.quant.split import split_problems
from tests.gpu_worker.quant_utils import quant_config

LLAMA: dict[str, Any] = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256,
                             intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)
KINDS = {"fp8-block": FP8_BLOCK, "ct-fp8": CT_FP8, "ct-w4a16": CT_W4A16, "gptq": GPTQ,
         "awq": AWQ}


def _q(q: dict[str, Any]) -> QuantConfig | None:
    return parse({"quantization_config": q})


@pytest.mark.parametrize("fmt", list(KINDS))
def test_published_and_transformers_5_spellings_read_alike(fmt: str) -> None:
    """Published checkpoints carry keys transformers 5 does not write (GPTQ's
    `damp_percent`, `true_sequential`, `model_name_or_path`, AWQ's `zero_point`,
    `version`) and the other way round (`dequantize`, `format`, `act_group_aware`)."""
    published = _q(quant_config(fmt, 128, (128, 128), published=True))
    written = _q(quant_config(fmt, 128, (128, 128), published=False))
    assert published == written
    assert published is not None and published.kind == KINDS[fmt]
    if published.is_int4:
        assert published.group_size == 128


def test_qwen3_fp8_config_as_published() -> None:
    q = _q({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]})
    assert q == QuantConfig(FP8_BLOCK, block=(128, 128))
    assert q.quantized("model.layers.3.mlp.down_proj")


def test_unquantized_modules_are_honoured() -> None:
    q = _q({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [8, 8],
            "modules_to_not_convert": ["lm_head", "model.layers.1.mlp"]})
    assert q is not None
    assert not q.quantized("model.layers.1.mlp.down_proj")
    assert q.quantized("model.layers.0.mlp.down_proj")
    ct = quant_config("ct-w4a16", 32, (0, 0), False)
    ct["ignore"] = ["lm_head", "re:.*layers\\.0\\.self_attn\\.[qkv]_proj$"]
    c = _q(ct)
    assert c is not None and c.group_size == 32
    assert not c.quantized("model.layers.0.self_attn.k_proj")
    assert c.quantized("model.layers.0.self_attn.o_proj")
    assert c.quantized("model.layers.10.self_attn.k_proj")


def _set(cfg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    *keys, last = path.split(".")
    node = out
    for k in keys:
        node = node[k]
    node[last] = value
    return out


REFUSED = [
    ("fp8-block", "quant_method", "bitsandbytes", "quant_method 'bitsandbytes'"),
    ("fp8-block", "activation_scheme", "static", "activation_scheme 'static'"),
    ("fp8-block", "fmt", "e5m2", "fmt 'e5m2'"),
    ("fp8-block", "weight_block_size", None, "weight_block_size None"),
    ("gptq", "bits", 8, "bits 8"),
    ("gptq", "group_size", 16, "group_size 16"),
    ("gptq", "desc_act", True, "desc_act True"),
    ("gptq", "sym", False, "sym False"),
    ("gptq", "checkpoint_format", "gptq_v2", "checkpoint_format 'gptq_v2'"),
    ("awq", "version", "gemv", "version 'gemv'"),
    ("awq", "zero_point", False, "zero_point False"),
    ("awq", "bits", 3, "bits 3"),
    ("ct-w4a16", "config_groups.group_0.weights.symmetric", False,
     "config_groups.group_0.weights.symmetric False"),
    ("ct-w4a16", "config_groups.group_0.weights.actorder", "group",
     "config_groups.group_0.weights.actorder 'group'"),
    ("ct-w4a16", "config_groups.group_0.weights.num_bits", 8,
     "config_groups.group_0.weights.num_bits 8"),
    ("ct-w4a16", "ignore", [], "ignore []"),
    ("ct-w4a16", "kv_cache_scheme", {"num_bits": 8}, "kv_cache_scheme"),
    ("ct-w4a16", "format", "marlin-24", "format 'marlin-24'"),
    ("ct-fp8", "config_groups.group_0.input_activations.dynamic", False,
     "input_activations.dynamic False"),
    ("ct-fp8", "config_groups.group_0.weights.strategy", "block",
     "weights.strategy 'block'"),
    ("ct-fp8", "config_groups.group_0.targets", ["re:.*mlp.*"], "targets"),
]


@pytest.mark.parametrize("fmt, key, value, named", REFUSED,
                         ids=[f"{f}-{k}" for f, k, _, _ in REFUSED])
def test_refused_naming_key_and_value(fmt: str, key: str, value: Any, named: str) -> None:
    cfg = _set(quant_config(fmt, 128, (128, 128), published=True), key, value)
    with pytest.raises(ValueError, match="quantization_config") as err:
        _q(cfg)
    assert named in str(err.value)
    assert "supported" in str(err.value)


def test_quantized_moe_and_phi3_are_refused() -> None:
    q = quant_config("fp8-block", 128, (128, 128), True)
    moe = dict(LLAMA, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=64, quantization_config=q)
    with pytest.raises(ValueError, match="quantized Qwen3MoeForCausalLM.*mixture-of-experts"):
        ModelArgs.from_hf_config(moe)
    with pytest.raises(ValueError, match="Phi3ForCausalLM"):
        ModelArgs.from_hf_config(dict(LLAMA, architectures=["Phi3ForCausalLM"],
                                      quantization_config=q))


def _args(fmt: str, group: int = 128, block: tuple[int, int] = (128, 128), **kw: Any
          ) -> ModelArgs:
    cfg = dict(LLAMA, **kw, quantization_config=quant_config(fmt, group, block, True))
    return ModelArgs.from_hf_config(cfg)


def test_tensor_parallel_sizes_that_split_a_group_or_block_are_refused() -> None:
    # o_proj's 256 input columns over 4 ranks: 64 each, which splits a group of 128.
    assert split_problems(_args("gptq"), 2) == []
    problems = split_problems(_args("gptq"), 4)
    assert problems and "--tensor-parallel-size 4 would split a group (group_size 128)" \
        in problems[0] and "o_proj's input columns [64, 128) on rank 1" in problems[0]
    assert split_problems(_args("gptq", group=32), 4) == []
    assert "weight_block_size block of 128" in split_problems(_args("fp8-block"), 4)[0]
    # Output rows may cut a block: each rank reads the scale rows its rows use.
    assert split_problems(_args("fp8-block", block=(256, 64)), 4) == []
    # Per-channel scales have no groups to split.
    assert split_problems(_args("ct-fp8"), 4) == []
    assert split_problems(_args("awq", group=0), 4) == []


def test_shapes_the_packing_cannot_hold_are_refused() -> None:
    problems = split_problems(_args("awq", group=128, intermediate_size=320), 1)
    assert any("down_proj's 320 input columns are not a multiple of quantization_config "
               "group_size 128" in p for p in problems)


def test_per_channel_int4_is_group_size_minus_one() -> None:
    assert _q(quant_config("gptq", 0, (0, 0), True)) == QuantConfig(GPTQ, group_size=0)
    assert _q(quant_config("ct-w4a16", 0, (0, 0), True)) == QuantConfig(
        CT_W4A16, group_size=0, ignore=("lm_head",))
    with pytest.raises(ValueError, match="group_size 0 is not supported"):
        _q(dict(quant_config("gptq", 0, (0, 0), True), group_size=0))
