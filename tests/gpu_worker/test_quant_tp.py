"""Quantized checkpoints at tensor parallel size 2 (two ranks joined by gloo on 127.0.0.1).

Each rank reads its part of the packed tensors (`models.quant.tensors.parts`: GPTQ and AWQ
store [in, out], scales one row per group, fp8 block scales a row per block of rows), so
greedy continuations of every format equal HF on the dequantized weights; a GPTQ serving run
(K=8 per step and K=1 after the plan) equals HF; and adapters over a quantized base with a
guided row beside them equal the same run on the float reference at TP=1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu_worker import tp_job
from tests.gpu_worker.guided_utils import guided_checkpoint
from tests.gpu_worker.model_utils import make_tiny_checkpoint
from tests.gpu_worker.quant_utils import FORMATS, quantize
from tests.gpu_worker.runner_driver import hf_greedy
from tests.lora_utils import make_adapters

RUNNER_FORMAT = "gptq"
LORA_FORMAT = "awq"
LORA_REGEX = r'\{"name": "[a-z]{1,6}", "n": [0-9]{1,3}\}'


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("tp-quant")
    llama = make_tiny_checkpoint(root, "llama", tokenizer=False, seed=5)
    # Blocks of 48 rows: the ranks' q|k|v rows start inside a block.
    return {fmt: quantize(llama, root, fmt, group=32, block=(48, 32)) for fmt in FORMATS}


@pytest.fixture(scope="module")
def lora_specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The adapter run on the quantized checkpoint, and on its float reference."""
    root = tmp_path_factory.mktemp("tp-quant-lora")
    quant, ref = quantize(guided_checkpoint(root), root, LORA_FORMAT, group=32)
    cache = root / "adapters"
    cache.mkdir()
    make_adapters(ref, cache, tp_job.LORA_SLOTS)
    return {p: {"path": path, "cache": str(cache), "regex": LORA_REGEX}
            for p, path in (("quant", quant), ("ref", ref))}


@pytest.fixture(scope="module")
def ranks(ckpts: dict[str, tuple[str, str]], lora_specs: dict[str, dict[str, str]],
          tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    models = {fmt: quant for fmt, (quant, _) in ckpts.items()}
    return tp_job.launch({"models": models, "runner": models[RUNNER_FORMAT],
                          "lora": lora_specs["quant"], "served": False},
                         tmp_path_factory.mktemp("tp-q-out"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_equals_hf_on_the_dequantized_weights(ranks: list[dict[str, Any]],
                                                     ckpts: dict[str, tuple[str, str]],
                                                     fmt: str) -> None:
    got = ranks[0]["models"][fmt]
    ref = ckpts[fmt][1]
    for prompt, out in zip(got["prompts"], got["greedy"], strict=True):
        assert out == hf_greedy(ref, prompt, tp_job.GREEDY_TOKENS)
    assert ranks[1]["models"][fmt]["greedy"] == got["greedy"]
    assert torch.isfinite(got["guarded"]).all()


@pytest.mark.parametrize("mode", ["async_k8", "sync_k1"])
def test_gptq_serving_run_equals_hf(ranks: list[dict[str, Any]],
                                    ckpts: dict[str, tuple[str, str]], mode: str) -> None:
    got = ranks[0][mode]
    for rid in (0, 1, 3):  # the greedy requests
        assert got["out"][rid] == hf_greedy(ckpts[RUNNER_FORMAT][1], got["prompts"][rid]), rid
    assert ranks[1][mode]["out"] == got["out"]


def test_adapters_and_a_guided_row_over_a_quantized_base(
        ranks: list[dict[str, Any]], lora_specs: dict[str, dict[str, str]]) -> None:
    """The float reference's run at TP=1 is what the TP tests prove equal to PEFT."""
    torch.set_num_threads(1)
    got = ranks[0]["lora"]
    assert got["loaded"] == {1: "attn", 2: "all"}
    assert ranks[1]["lora"]["out"] == got["out"]
    assert tp_job.lora_outputs(lora_specs["ref"], None)["out"] == got["out"]


def test_the_runner_logs_weight_bytes(ckpts: dict[str, tuple[str, str]], tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    from tandem_serve.gpu_worker.models.loader import load_model

    with caplog.at_level("INFO", logger="tandem_serve.gpu_worker.models.loader"):
        load_model(ckpts["gptq"][0], torch.float32, torch.device("cpu"), keep_quantized=True)
    assert any("weights:" in r.message and "GiB" in r.message and "gptq, kept quantized: "
               "int4-cpu" in r.message for r in caplog.records), caplog.text
