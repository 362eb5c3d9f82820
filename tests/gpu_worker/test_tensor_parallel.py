"""Tensor parallelism over real ranks: two processes joined by gloo on 127.0.0.1.

One job (`tp_job.py`, two ranks) loads every architecture's shards and runs the model and a
scripted serving run; these tests compare what it wrote with TP=1 in this process and with
HF `generate()`:

* prefill logits equal TP=1 within 1e-5 (relative to the logits' scale: both sides sum the
  same products in a different order) and are no further from a float64 reference;
* greedy continuations equal HF, on GQA, a single KV head (replicated to both ranks), biases
  on q/k/v/o and the MLP (row-parallel biases added once), tied embeddings and Qwen3's q/k
  norms;
* through ModelRunner.execute, K=8 publishing per step and K=1 publishing after the plan:
  greedy equals HF, seeded sampling (with top-p/top-k, a repetition penalty) equals TP=1,
  logprobs and prompt logprobs match, the K-step loop runs under the host-sync guard
  (collectives included), and rank 1's state is rank 0's;
* the real scheduler's plans, prompts prefilling in pieces inside the decode steps: rank 1
  runs rank 0's plans, greedy equals HF and a seeded row TP=1;
* with LoRA adapters (attention-only and all-linear, each rank holding its part of A and B)
  and a guided row (one of them under an adapter) beside base rows: greedy equals PEFT's
  generate() (with the same guide's LogitsProcessor for the guided rows) and TP=1.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu_worker import tp_job
from tests.gpu_worker.guided_utils import guided_checkpoint, hf_guided
from tests.gpu_worker.model_utils import make_tiny_checkpoint
from tests.gpu_worker.runner_driver import hf_greedy
from tests.lora_utils import make_adapters, peft_greedy

# name -> (arch, checkpoint kwargs)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", dict(seed=5)),
    "llama-single-kv-head-tied": ("llama", dict(num_key_value_heads=1,
                                                tie_word_embeddings=True, seed=6)),
    "llama-attn-mlp-bias": ("llama", dict(attention_bias=True, mlp_bias=True, seed=7)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True, seed=1)),
    "qwen3-qk-norm": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                    seed=2)),
}
RUNNER_ARCH = "llama-gqa"
# The guided row's constraint in the adapter run: a JSON object of a name and a number.
LORA_REGEX = r'\{"name": "[a-z]{1,6}", "n": [0-9]{1,3}\}'


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-ckpts")
    return {name: make_tiny_checkpoint(root, arch, tokenizer=False, **kw)
            for name, (arch, kw) in ARCHS.items()}


@pytest.fixture(scope="module")
def lora_spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The adapter run's checkpoint (the tiny llama with its tokenizer, for the regex) and
    its adapter cache."""
    path = guided_checkpoint(tmp_path_factory.mktemp("tp-lora-ckpt"))
    cache = tmp_path_factory.mktemp("tp-adapters")
    make_adapters(path, cache, tp_job.LORA_SLOTS)
    return {"path": path, "cache": str(cache), "regex": LORA_REGEX}


@pytest.fixture(scope="module")
def ranks(paths: dict[str, str], lora_spec: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run the two-rank job once; what each rank wrote."""
    return tp_job.launch({"models": paths, "runner": paths[RUNNER_ARCH], "lora": lora_spec},
                         tmp_path_factory.mktemp("tp-out"))


@pytest.fixture(scope="module")
def reference(paths: dict[str, str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: tp_job.model_outputs(path, None) for name, path in paths.items()}


def _f64_logits(path: str, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])


@pytest.mark.parametrize("name", list(ARCHS))
def test_prefill_logits_equal_tp1(ranks: list[dict[str, Any]], reference: dict[str, Any],
                                  paths: dict[str, str], name: str) -> None:
    tp2 = ranks[0]["models"][name]["logits"]
    tp1 = reference[name]["logits"]
    scale = tp1.abs().max().item()
    assert (tp2 - tp1).abs().max().item() <= 1e-5 * scale
    # Both are float32 sums of the same products in different orders: neither is closer to
    # the exact answer.
    exact = _f64_logits(paths[name], reference[name]["prompts"])
    err1 = (tp1.double() - exact).abs().max().item()
    err2 = (tp2.double() - exact).abs().max().item()
    assert err2 <= 2 * err1 + 1e-6, (err1, err2)
    torch.testing.assert_close(ranks[1]["models"][name]["logits"], tp2, rtol=0, atol=0)
    # One decode forward ran under the host-sync guard, its collectives included.
    assert torch.isfinite(ranks[0]["models"][name]["guarded"]).all()


def test_the_guard_is_live_in_a_rank(ranks: list[dict[str, Any]]) -> None:
    """What the guard let through above, it lets through with its eyes open."""
    assert ranks[0]["guard_sees_host_reads"] and ranks[1]["guard_sees_host_reads"]


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_equals_hf(ranks: list[dict[str, Any]], paths: dict[str, str],
                          name: str) -> None:
    got = ranks[0]["models"][name]
    for prompt, out in zip(got["prompts"], got["greedy"], strict=True):
        assert out == hf_greedy(paths[name], prompt, tp_job.GREEDY_TOKENS)
    assert ranks[1]["models"][name]["greedy"] == got["greedy"]


def test_kv_heads_split_or_replicated(ranks: list[dict[str, Any]]) -> None:
    models = ranks[0]["models"]
    assert models["llama-gqa"]["kv_heads"] == 1  # 2 kv heads over 2 ranks
    assert models["llama-single-kv-head-tied"]["kv_heads"] == 1  # 1 head, replicated
    assert models["qwen3-qk-norm"]["kv_heads"] == 1


@pytest.fixture(scope="module")
def runner_reference(paths: dict[str, str]) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    path = paths[RUNNER_ARCH]
    return {"async_k8": tp_job.runner_outputs(path, None, 8, True),
            "sync_k1": tp_job.runner_outputs(path, None, 1, False)}


@pytest.mark.parametrize("mode", ["async_k8", "sync_k1"])
def test_runner_streams_equal_hf_and_tp1(ranks: list[dict[str, Any]], paths: dict[str, str],
                                         runner_reference: dict[str, dict[str, Any]],
                                         mode: str) -> None:
    got, ref = ranks[0][mode], runner_reference[mode]
    prompts = got["prompts"]
    for rid in (0, 1, 3):  # greedy
        assert got["out"][rid] == hf_greedy(paths[RUNNER_ARCH], prompts[rid]), rid
    assert got["out"] == ref["out"]  # seeded sampling included (requests 2 and 4)
    assert len(set(got["out"][2])) > 5, "the sampled request should vary"
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(got["prompt_logprobs"]) == len(ref["prompt_logprobs"]) > 0
    for a, b in zip(got["prompt_logprobs"], ref["prompt_logprobs"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert ranks[1][mode]["out"] == got["out"]
    assert got["num_blocks"] == ranks[1][mode]["num_blocks"] == ref["num_blocks"]


def test_prefill_pieces_in_decode_steps_equal_hf_and_tp1(ranks: list[dict[str, Any]],
                                                         paths: dict[str, str]) -> None:
    """Mixed steps (the scheduler's per-step pieces) under TP=2: rank 1 runs rank 0's plans
    and state, greedy equals HF, the seeded row equals TP=1."""
    got = ranks[0]["served"]
    assert got["spread"], "prompts were cut into pieces over the steps"
    assert ranks[1]["served"]["out"] == got["out"]
    assert tp_job.served_outputs(paths[RUNNER_ARCH], None)["out"] == got["out"]
    for rid, prompt in enumerate(got["prompts"]):
        if rid != 1:  # greedy
            assert got["out"][rid] == hf_greedy(paths[RUNNER_ARCH], prompt), rid


def test_triton_attention_equals_tp1(ranks: list[dict[str, Any]]) -> None:
    """The Triton backend on each rank's own heads (under the interpreter without a GPU):
    the mixed-step workload's tokens of TP=1 (test above)."""
    assert ranks[0]["served_triton"]["out"] == ranks[1]["served_triton"]["out"] == \
        ranks[0]["served"]["out"]


def test_fp8_kv_cache_equals_tp1(ranks: list[dict[str, Any]], paths: dict[str, str]) -> None:
    """Each rank's fp8 cache holds its own KV heads (scale 1.0: nothing to agree on across
    ranks): the same tokens as TP=1 on an fp8 cache, on both ranks."""
    got = ranks[0]["served_fp8"]
    assert ranks[1]["served_fp8"]["out"] == got["out"]
    assert tp_job.served_outputs(paths[RUNNER_ARCH], None, kv_cache_dtype="fp8")["out"] == \
        got["out"]


def test_speculation_equals_hf_and_tp1(ranks: list[dict[str, Any]],
                                      paths: dict[str, str]) -> None:
    """N-gram speculation under TP=2 (copy-heavy prompts): every eligible row speculating,
    then the measured rule (each rank times its own forwards and the ranks agree on the
    largest, so they pick the same rows): both ranks equal, greedy equals HF, drafts were
    accepted."""
    for run in ("served_spec", "served_spec_rule"):
        got = ranks[0][run]
        assert ranks[1][run]["out"] == got["out"], run
        for rid, prompt in enumerate(got["prompts"]):
            if rid != 1:  # greedy
                assert got["out"][rid] == hf_greedy(paths[RUNNER_ARCH], prompt), (run, rid)
    assert ranks[0]["served_spec"]["accepted"] > 0
    # draft_model: the draft is whole on every rank (no collectives), each rank drafts alike.
    got = ranks[0]["served_draft"]
    assert ranks[1]["served_draft"]["out"] == got["out"] == ranks[0]["served_spec"]["out"]
    assert got["accepted"] > 0
    assert tp_job.served_outputs(paths[RUNNER_ARCH], None, speculative=tp_job.SPEC)["out"] == \
        ranks[0]["served_spec"]["out"]


def test_adapters_and_a_guided_row_equal_peft_and_tp1(ranks: list[dict[str, Any]],
                                                       lora_spec: dict[str, str]) -> None:
    torch.set_num_threads(1)
    got = ranks[0]["lora"]
    assert got["loaded"] == {1: "attn", 2: "all"}
    assert ranks[1]["lora"]["out"] == got["out"]
    assert tp_job.lora_outputs(lora_spec, None)["out"] == got["out"]
    path, cache, prompts = lora_spec["path"], lora_spec["cache"], got["prompts"]
    base: dict[int, list[int]] = {}
    for rid, (adapter, is_guided) in tp_job.LORA_ROWS.items():
        folder = f"{cache}/{adapter}" if adapter else None
        if is_guided:
            want = hf_guided(path, LORA_REGEX, prompts[rid], tp_job.GUIDED_TOKENS,
                             adapter=folder)
            assert want[-1] == 2, "the constraint completes (EOS) within the budget"
        else:
            [want] = peft_greedy(path, folder, [prompts[rid]], tp_job.LORA_TOKENS,
                                 tp_job.LORA_TOKENS)
            [base[rid]] = peft_greedy(path, None, [prompts[rid]], tp_job.LORA_TOKENS,
                                      tp_job.LORA_TOKENS)
        assert got["out"][rid] == want, f"request {rid} ({adapter or 'base'})"
    # The adapters change the output: parity with PEFT would otherwise prove nothing.
    for rid in (1, 2, 5):
        assert got["out"][rid] != base[rid], rid
    assert got["out"][4] != hf_guided(path, LORA_REGEX, prompts[4], tp_job.GUIDED_TOKENS)
