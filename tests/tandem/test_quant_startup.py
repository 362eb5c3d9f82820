"""A quantized checkpoint Tandem does not implement is one `tandem: error:` line naming the
key and value (exit status 2) before any process starts; so is a tensor-parallel size that
would split a scale group."""
from __future__ import annotations

import json
import pathlib
from typing import Any

from tandem_serve.harness.processes import free_port
from tests.tandem.test_startup_errors import assert_one_line_error, serve

LLAMA: dict[str, Any] = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                             vocab_size=512, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# Qwen3-FP8's quantization_config as published, but with static activation scales.
FP8_STATIC = {"activation_scheme": "static", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}
GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": False, "sym": True,
        "true_sequential": True, "model_name_or_path": None, "quant_method": "gptq"}


def _folder(tmp_path: pathlib.Path, quant: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": quant}))
    return str(tmp_path)


def test_an_unsupported_fp8_config_is_refused_at_start(tmp_path: pathlib.Path) -> None:
    proc = serve("--model", _folder(tmp_path, FP8_STATIC), "--port", str(free_port()))
    line = assert_one_line_error(proc, "--model", "quantization_config.activation_scheme "
                                 "'static' is not supported", "'dynamic'")
    assert proc.stderr.strip() == line


def test_act_order_is_refused_at_start(tmp_path: pathlib.Path) -> None:
    proc = serve("--model", _folder(tmp_path, {**GPTQ, "desc_act": True}),
                 "--port", str(free_port()))
    assert_one_line_error(proc, "quantization_config.desc_act True is not supported")


def test_a_tensor_parallel_size_that_splits_a_group_is_refused(tmp_path: pathlib.Path) -> None:
    proc = serve("--model", _folder(tmp_path, GPTQ), "--port", str(free_port()),
                 "--tensor-parallel-size", "4")
    assert_one_line_error(proc, "cannot be split", "--tensor-parallel-size 4 would split a "
                          "group (group_size 128)", "o_proj")
