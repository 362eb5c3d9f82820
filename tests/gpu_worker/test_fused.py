"""The fused Triton kernels (`gpu_worker.models.fused`) against the eager torch code they
replace, and the decoder layer with them against the layer without.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by tests/conftest.py before anything imports triton); with one, compiled on CUDA.
The interpreter rounds float32 -> bfloat16 toward zero where the GPU rounds to nearest even,
so bfloat16 results are compared within bfloat16's resolution; float32 within 1e-5.
Shapes stay tiny and odd (48, 96, 24-dim heads): the interpreter runs every program in Python.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
# `triton`: gpu-check's gpu tests stage runs these compiled on a GPU host.
pytestmark = pytest.mark.triton

from tandem_serve.gpu_worker.models import fused, layers  # noqa: E402
from tandem_serve.gpu_worker.models.config import ModelArgs  # noqa: E402
from tandem_serve.gpu_worker.models.decoder import DecoderLayer  # noqa: E402
from tandem_serve.gpu_worker.models.rope import model_ropes  # noqa: E402
from tests.gpu_worker.triton_utils import DEVICE  # noqa: E402

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[want.dtype])


def _norm_weight(n: int, dtype: torch.dtype, gemma: bool, rows: int = 0) -> torch.Tensor:
    shape = (rows, n) if rows else (n,)
    w = _randn(*shape, seed=3) * 0.1
    return 1.0 + w if gemma else (1.0 + w).to(dtype)  # Gemma's is (1 + w) in float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("n", [48, 96])
def test_rms_norm(dtype: torch.dtype, gemma: bool, n: int) -> None:
    x = _randn(5, n, dtype=dtype) * 3
    w = _norm_weight(n, dtype, gemma)
    eager = layers.gemma_rms_norm if gemma else layers.rms_norm
    with fused.forced():
        got = (fused.gemma_rms_norm if gemma else fused.rms_norm)(x, w, 1e-6)
    _check(got, eager(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_of_a_strided_qk_view(dtype: torch.dtype) -> None:
    """Qwen3 / Gemma 3's q|k norm: heads of a fused qkv row, a weight row per head."""
    hq, hkv, d = 4, 2, 24
    qkv = _randn(3, (hq + 2 * hkv) * d, dtype=dtype).view(3, hq + 2 * hkv, d)
    qk = qkv[:, : hq + hkv]
    w = _norm_weight(d, dtype, False, rows=hq + hkv)
    before = qkv.clone()
    with fused.forced():
        got = fused.rms_norm(qk, w, 1e-6)
    _check(got, layers.rms_norm(qk, w, 1e-6))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm(dtype: torch.dtype, gemma: bool) -> None:
    """x + a then the norm; Gemma's sandwich norms a (with its own weight) before the add."""
    n = 96
    x, a = _randn(4, n, dtype=dtype, seed=1), _randn(4, n, dtype=dtype, seed=2) * 2
    w = _norm_weight(n, dtype, gemma)
    pre = _norm_weight(n, dtype, gemma) * 0.5 if gemma else None
    norm = layers.gemma_rms_norm if gemma else layers.rms_norm
    res = x + (a if pre is None else norm(a, pre, 1e-6))
    x0, a0 = x.clone(), a.clone()
    with fused.forced():
        h, got_res = fused.add_rms_norm(x, a, w, 1e-6, gemma, pre)
    _check(got_res, res)
    _check(h, norm(res, w, 1e-6))
    assert torch.equal(x, x0) and torch.equal(a, a0)


def _cos_sin(t: int, rot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    args = ModelArgs("LlamaForCausalLM", 64, 48, 96, 1, 2, 1, 24, 1e-6, 4096, rotary_dim=rot)
    positions = torch.tensor([0, 7, 300, 4095, 12][:t], device=DEVICE)
    return model_ropes(args)[0][0].to(torch.device(DEVICE)).cos_sin(positions, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,rot", [(24, 24), (40, 24)])
def test_rope_in_place_on_the_qkv_row(dtype: torch.dtype, d: int, rot: int) -> None:
    """Full and partial rotary (Phi-3: the last d - rot dims pass through), q|k a strided
    view of the fused qkv output; v stays as it was."""
    hq, hkv, t = 4, 2, 5
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype).view(t, hq + 2 * hkv, d)
    qk = qkv[:, : hq + hkv]
    cos, sin = _cos_sin(t, rot, dtype)
    want = layers.apply_rope(qk, cos, sin)
    v = qkv[:, hq + hkv:].clone()
    with fused.forced():
        got = fused.rope(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    _check(got, want)
    if rot < d:
        assert torch.equal(got[..., rot:], want[..., rot:])
    assert torch.equal(qkv[:, hq + hkv:], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("inter", [48, 96])
def test_act_mul(dtype: torch.dtype, act: str, inter: int) -> None:
    gu = _randn(3, 2 * inter, dtype=dtype) * 3
    with fused.forced():
        got = fused.act_mul(gu, act, inter)
    _check(got, layers.ACTIVATIONS[act](gu[:, :inter]) * gu[:, inter:])


def test_cpu_tensors_take_the_eager_code_unless_forced() -> None:
    x = torch.randn(3, 48)
    w = torch.randn(48)
    assert not fused.use_triton(x)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), layers.rms_norm(x, w, 1e-6))
    with fused.forced():
        assert fused.use_triton(x)
    assert not fused.use_triton(x)


def _eager_called(*args: object) -> None:
    raise AssertionError("the eager function ran on the Triton path")


FAMILIES = {
    "llama": {},
    "phi3-partial-rotary": {"rotary_dim": 16},
    "gemma3": {"gemma_norms": True, "qk_norm": True, "hidden_act": "gelu_pytorch_tanh"},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layer_with_the_kernels_equals_the_layer_without(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: a layer's two row-wise parts (around attention) through the kernels equal
    the eager ones, in float32, and no eager norm, RoPE or activation runs on that path."""
    args = ModelArgs("LlamaForCausalLM", 64, 48, 40, 1, 4, 2, 24, 1e-6, 4096,
                     **FAMILIES[family])  # type: ignore[arg-type]
    layer = DecoderLayer(args, 0)
    for i, (name, p) in enumerate(list(layer.named_parameters())):
        w = _randn(*p.shape, seed=10 + i) * (0.1 if p.dim() == 1 else 0.2)
        setattr(layer, name, nn.Parameter(w + 1.0 if p.dim() == 1 else w, requires_grad=False))
    if args.qk_norm:
        layer.qk_norm_weight = nn.Parameter(_randn(6, 24, seed=5) * 0.1 + 1.0,
                                            requires_grad=False)
    x, a = _randn(5, 48, seed=1), _randn(5, 4 * 24, seed=2)
    cos_sin = _cos_sin(5, args.rotary_dim or args.head_dim, torch.float32)
    with torch.inference_mode():
        want = [*layer.project_qkv(layer.norm(x, layer.input_norm, 1e-6), cos_sin, None),
                layer.after_attention(x, a, None)]
        for name in ("rms_norm", "gemma_rms_norm", "apply_rope"):
            monkeypatch.setattr(layers, name, _eager_called)
        monkeypatch.setattr(layers, "ACTIVATIONS", {})
        with fused.forced():
            got = [*layer.project_qkv(layer.norm(x, layer.input_norm, 1e-6), cos_sin,
                                      None), layer.after_attention(x, a, None)]
    for g, w in zip(got, want, strict=True):
        _check(g, w)
