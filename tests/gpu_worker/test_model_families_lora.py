"""LoRA adapters and guided rows on the new families, against PEFT's and HF's generate().

Qwen3-MoE: an attention adapter beside base rows and guided rows, one of them under the
adapter. What reaches the experts is refused, naming the adapter: PEFT (with transformers 5,
which keeps experts as stacked parameters) turns any MLP target of an MoE model into
`target_parameters` on the experts, which the adapter reader refuses; a hand-made adapter on
the MLP of an expert layer passes the reader (names and shapes are those of a dense MLP) and
is refused by the worker, failing only its requests. Phi-3: an adapter on o_proj and
down_proj is served; one on its fused qkv_proj is refused, naming the adapter.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem_serve.adapters.peft import AdapterError, ModelShapes, read_adapter
from tandem_serve.gpu_worker.models.loader import load_model_args
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tests.gpu_worker.family_utils import checkpoint
from tests.gpu_worker.guided_utils import guided, hf_guided, table
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import Driver, make_runner
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.lora_utils import ADAPTERS, make_adapter, peft_greedy

NEW = 16
GUIDED_NEW = 40
REGEX = r'\{"name": "[a-z]{1,6}", "n": [0-9]{1,3}\}'
# request -> (adapter or None, guided)
ROWS: dict[int, tuple[str | None, bool]] = {
    0: (None, False), 1: ("attn", False), 2: (None, True), 3: ("attn", True),
    4: ("attn", False)}
SLOTS = {"attn": 1, "experts": 2}


def _adapters(path: str, cache: Path) -> None:
    make_adapter(path, cache / "attn", **ADAPTERS["attn"])
    make_adapter(path, cache / "all", r=4, lora_alpha=8, target_modules="all-linear", seed=13)
    # The attention adapter plus a gate_proj on layer 0, whose MLP is experts: names and
    # shapes of a dense MLP (intermediate_size), so only the worker can refuse it.
    shutil.copytree(cache / "attn", cache / "experts")
    config_path = cache / "experts" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = [*config["target_modules"], "gate_proj"]
    config_path.write_text(json.dumps(config))
    path_st = cache / "experts" / "adapter_model.safetensors"
    tensors = load_file(path_st)
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_{}.weight"
    tensors[key.format("A")] = torch.ones(4, 64)
    tensors[key.format("B")] = torch.ones(96, 4)
    save_file(tensors, path_st, metadata={"format": "pt"})


def test_adapters_and_guided_rows_on_qwen3_moe(ckpt_root: Path,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    path = checkpoint(ckpt_root, "qwen3-moe", published=True, tokenizer=True)
    cache = tmp_path_factory.mktemp("moe-adapters")
    _adapters(path, cache)
    with pytest.raises(AdapterError, match="'all'.*target_parameters"):
        read_adapter(str(cache), "all", ModelShapes.of(load_model_args(path)), 16)
    runner = make_runner(path, num_kv_blocks=200, adapter_cache=str(cache), max_loras=3)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=4)
    constraint = table(path, REGEX)
    d.send_table(constraint)
    d.load(SLOTS["attn"], "attn")
    prompts = random_prompts([9, 33, 20, 14, 27, 12], 512, seed=9)
    exact = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, stop_token_ids=[EOS_ID])
    for rid, (adapter, is_guided) in ROWS.items():
        if rid == 4:  # joins the running batch, beside a request whose adapter fails
            d.run(3)
            d.load(SLOTS["experts"], "experts")
            d.add(5, prompts[5], exact, lora_slot=SLOTS["experts"])
        d.add(rid, prompts[rid], guided(constraint, GUIDED_NEW) if is_guided else exact,
              lora_slot=SLOTS[adapter] if adapter else 0)
    d.run_until_done([8, 1, 5])
    [failure] = runner.take_adapter_failures()
    assert (failure.adapter_id, failure.request_ids) == ("experts", [5])
    assert "mixture of experts" in failure.message and "'experts'" in failure.message
    assert d.reqs[5].finish == FinishReason.ERROR and d.reqs[5].out == []
    for rid, (adapter, is_guided) in ROWS.items():
        folder = str(cache / adapter) if adapter else None
        if is_guided:
            want = hf_guided(path, REGEX, prompts[rid], GUIDED_NEW, adapter=folder)
            assert want[-1] == EOS_ID, "the constraint completes within the budget"
        else:
            [want] = peft_greedy(path, folder, [prompts[rid]], NEW, NEW)
        assert d.reqs[rid].out == want, f"request {rid} ({adapter or 'base'})"
    [base] = peft_greedy(path, None, [prompts[1]], NEW, NEW)
    assert d.reqs[1].out != base, "the adapter changes the output"


def test_phi3_adapters_on_o_and_down_are_served_and_on_qkv_refused(
        ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = checkpoint(ckpt_root, "phi3", published=True)
    cache = tmp_path_factory.mktemp("phi3-adapters")
    make_adapter(path, cache / "od", r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"],
                 seed=3)
    make_adapter(path, cache / "fused", r=4, lora_alpha=8, target_modules=["qkv_proj"], seed=4)
    shapes = ModelShapes.of(load_model_args(path))
    with pytest.raises(AdapterError, match="'fused'.*qkv_proj"):
        read_adapter(str(cache), "fused", shapes, 16)
    runner = make_runner(path, num_kv_blocks=100, adapter_cache=str(cache), max_loras=1)
    d = Driver(runner, seed=5)
    d.load(1, "od")
    prompts = random_prompts([30, 80], 512, seed=2)  # short factors, and long ones
    exact = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, stop_token_ids=[EOS_ID])
    d.add(0, prompts[0], exact, lora_slot=1)
    d.add(1, prompts[1], exact, lora_slot=1)
    d.run_until_done([8])
    assert [d.reqs[0].out, d.reqs[1].out] == peft_greedy(path, cache / "od", prompts, NEW, NEW)
