"""Quantized checkpoints serve exactly what HF `generate()` (float32) serves on their
dequantized weights, for each of the five layouts (`quant_utils` writes them from a float
tiny checkpoint with power-of-two scales, so dequantization is exact).

Through `ModelRunner.execute` each format runs a busy batch (requests joining, a chunked
prefill, a preemption and resume, a prefix shared through another request's blocks) at K=8
publishing per step with the linears kept quantized (the int4 kernel's CPU twin, FP8
dequantized per forward), and at K=1 publishing after the plan with them dequantized at
load (the CPU's default), the K-step loop under the host-sync guard.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem_serve.gpu_worker.models import loader
from tandem_serve.gpu_worker.models.loader import load_model, weight_bytes
from tests.gpu_worker.model_utils import PagedDriver, make_tiny_checkpoint, random_prompts
from tests.gpu_worker.quant_utils import FORMATS, quantize
from tests.gpu_worker.runner_driver import Driver, hf_greedy, make_runner, run_busy_batch
from tests.gpu_worker.sync_guard import forbid_host_sync

CPU = torch.device("cpu")
# fp8-block: blocks that do not divide the rows (ragged last blocks, and fused q|k|v and
# gate|up parts that start inside a block).
BLOCK = (48, 32)


@pytest.fixture(scope="module")
def ckpts(ckpt_root: Path) -> dict[str, tuple[str, str]]:
    """format -> (quantized folder, dequantized float32 reference)."""
    root = ckpt_root / "quant"
    root.mkdir(exist_ok=True)
    llama = make_tiny_checkpoint(root, "llama", tokenizer=False, seed=5)
    qwen3 = make_tiny_checkpoint(root, "qwen3", tokenizer=False, seed=2)
    return {fmt: quantize(qwen3 if fmt == "fp8-block" else llama, root, fmt, group=32,
                          block=BLOCK) for fmt in FORMATS}


@pytest.mark.parametrize("k, per_step, kept", [(8, True, True), (1, False, False)],
                         ids=["async-k8-kept-quantized", "sync-k1-dequantized"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_busy_batch_equals_hf_on_the_dequantized_weights(
        ckpts: dict[str, tuple[str, str]], fmt: str, k: int, per_step: bool, kept: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    quant, ref = ckpts[fmt]
    monkeypatch.setattr(loader, "CPU_KEEPS_QUANTIZED", kept)
    runner = make_runner(quant)
    modes = {q.mode for layer in runner.model.layers for q in layer.quant.values()}
    assert modes == ({"dequantize"} if "fp8" in fmt else {"int4-cpu"}) if kept else not modes
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=len(fmt))
    want = [hf_greedy(ref, q) for q in run_busy_batch(d, k, per_step)]
    assert [d.reqs[r].out for r in range(6)] == want
    assert max(len(set(o)) for o in want) >= 8  # parity means something only if it varies


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_equal_the_reference_exactly_and_stay_small(
        ckpts: dict[str, tuple[str, str]], fmt: str) -> None:
    """Kept quantized, a model holds its linears in fewer bytes than float32, and they
    compute with the reference's weights bit for bit (read back through the identity)."""
    quant, ref = ckpts[fmt]
    dense = load_model(ref, torch.float32, CPU, onednn=False)
    kept = load_model(quant, torch.float32, CPU, onednn=False, keep_quantized=True)
    for a, b in zip(kept.layers, dense.layers, strict=True):
        for name, q in a.quant.items():
            eye = torch.eye(q.in_features)
            assert torch.equal(q.forward(eye).t(), getattr(b, name)), name
    linears = sum(getattr(layer, n).nbytes for layer in dense.layers
                  for n in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"))
    saved = weight_bytes(dense) - weight_bytes(kept)
    assert saved > linears * (0.7 if "fp8" in fmt else 0.8)


def test_a_paged_forward_kept_quantized_equals_dequantized(
        ckpts: dict[str, tuple[str, str]]) -> None:
    """Every format's kept-quantized model gives the dequantized model's logits."""
    prompts = random_prompts([5, 40, 17], 512, seed=1)
    for fmt in FORMATS:
        quant, _ = ckpts[fmt]
        logits = []
        for keep in (False, True):
            model = load_model(quant, torch.float32, CPU, keep_quantized=keep)
            driver = PagedDriver(model, num_blocks=32, block_size=16, seed=3)
            seqs = [driver.new_seq(p) for p in prompts]
            logits.append(driver.prefill([(s, len(s.tokens)) for s in seqs]))
        scale = logits[0].abs().max().item()
        assert (logits[0] - logits[1]).abs().max().item() <= 1e-5 * scale, fmt
