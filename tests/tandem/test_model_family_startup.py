"""A new family's config.json asking for what we do not implement, or not splitting over the
ranks, is one `tandem: error:` line naming the key (exit status 2), before anything starts."""
from __future__ import annotations

import json
import pathlib
import socket
from typing import Any

from tests.tandem.test_startup_errors import assert_one_line_error, serve

GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=512,
              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=32, sliding_window_pattern=2)
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512,
                 hidden_size=64, intermediate_size=128, moe_intermediate_size=33,
                 num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _folder(tmp_path: pathlib.Path, cfg: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_an_unimplemented_setting_is_named(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, {**GEMMA3, "attn_logit_softcapping": 50.0})
    assert_one_line_error(serve("--model", model, "--port", str(free_port())), "--model",
                          "attn_logit_softcapping")


def test_experts_that_do_not_split_are_named(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, QWEN3_MOE)
    proc = serve("--model", model, "--port", str(free_port()), "--tensor-parallel-size", "2")
    assert_one_line_error(proc, "cannot be split", "moe_intermediate_size 33",
                          "--tensor-parallel-size 2")
