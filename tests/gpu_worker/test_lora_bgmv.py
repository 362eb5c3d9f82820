"""BGMV LoRA kernels (`gpu_worker.lora_bgmv`) against the masked form they replace on CUDA
(`LoraContext` over every slot with a one-hot), under Triton's interpreter without a GPU
(see test_fused.py for why bfloat16 is compared within its resolution)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
# `triton`: gpu-check's gpu tests stage runs these compiled on a GPU host.
pytestmark = pytest.mark.triton

from tandem_serve.adapters.peft import ModelShapes  # noqa: E402
from tandem_serve.gpu_worker.lora import FUSED, LoraContext, LoraWeights  # noqa: E402
from tandem_serve.gpu_worker.models import fused  # noqa: E402
from tests.gpu_worker.triton_utils import DEVICE  # noqa: E402

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 3e-2}}
# hidden 48, 4 q heads and 2 kv heads of 12, intermediate 96: R_m = 3 * 4 = 12 for qkv.
SHAPES = ModelShapes(1, 100, {"q_proj": (48, 48), "k_proj": (24, 48), "v_proj": (24, 48),
                              "o_proj": (48, 48), "gate_proj": (96, 48), "up_proj": (96, 48),
                              "down_proj": (48, 96)})
# Rows of slots 1-3, none (0) and masked padding (-1), interleaved.
SLOTS = [2, 0, 1, 3, 2, -1, 1]


def _weights(dtype: torch.dtype) -> LoraWeights:
    w = LoraWeights(SHAPES, "", max_loras=3, max_rank=4, dtype=dtype,
                    device=torch.device(DEVICE))
    g = torch.Generator().manual_seed(0)
    for f in FUSED:
        for t in (w.a[0][f], w.bt[0][f]):
            t.copy_(torch.randn(t.shape, generator=g) * 0.15)
    w.a[0]["qkv"][12:24, :].zero_()  # slot 2 targets no qkv sub-module: adds exactly 0
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("module", list(FUSED))
def test_bgmv_equals_the_masked_form(dtype: torch.dtype, module: str) -> None:
    w = _weights(dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    n_in = w.a[0][module].shape[1]
    x = torch.randn(len(SLOTS), n_in, generator=g).to(DEVICE, dtype)
    out = torch.randn(len(SLOTS), w.bt[0][module].shape[1], generator=g).to(DEVICE, dtype)
    masked = LoraContext(w, slots)
    assert not masked.bgmv
    want = masked.add(0, module, x, out.clone())
    with fused.forced():
        ctx = LoraContext(w, slots)
    assert ctx.bgmv
    got = out.clone()
    assert ctx.add(0, module, x, got) is got
    torch.testing.assert_close(got, want, **TOL[dtype])
    # No adapter (0) and padding (-1): out untouched, bit for bit.
    for row in (1, 5):
        assert torch.equal(got[row], out[row])
    if module == "qkv":
        assert torch.equal(got[[0, 4]], out[[0, 4]])


def test_strided_input_and_output() -> None:
    """The o module's input is attention's output reshaped; out may be a column slice."""
    from tandem_serve.gpu_worker.lora_bgmv import add_lora

    w = _weights(torch.float32)
    slots = torch.tensor(SLOTS, device=DEVICE)
    a, bt = w.a[0]["o"], w.bt[0]["o"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, len(SLOTS), generator=g).to(DEVICE).t()  # column-major
    base = torch.randn(len(SLOTS), 2 * 48, generator=g).to(DEVICE)
    out = base[:, ::2]  # not unit-stride: written through a contiguous copy
    want = LoraContext(w, slots).add(0, "o", x.contiguous(), out.clone())
    add_lora(x, a, bt, slots, out, w.rows["o"])
    torch.testing.assert_close(base[:, ::2], want, rtol=1e-5, atol=1e-5)
