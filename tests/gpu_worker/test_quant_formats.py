"""The layouts read word for word, the checkpoints as published (group 128, 128×128 blocks,
Qwen3-FP8's bf16 and DeepSeek-V3's float32 block scales), the kernels against the
dequantized matmul, and the checkpoint mistakes that must stop a load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem_serve.gpu_worker.models.loader import load_model
from tandem_serve.gpu_worker.models.quant.config import QuantConfig
from tandem_serve.gpu_worker.models.quant.formats import (
    FP8,
    Fp8Weight,
    Int4Weight,
    read_linear,
)
from tandem_serve.gpu_worker.models.quant.linear import QuantLinear, fp8_rowwise_mm
from tandem_serve.gpu_worker.models.sharding import Part
from tests.gpu_worker.model_utils import PagedDriver, make_tiny_checkpoint, random_prompts
from tests.gpu_worker.quant_utils import FORMATS, assert_pow2, quantize
from tests.gpu_worker.runner_driver import hf_greedy

CPU = torch.device("cpu")
# 0x76543210: nibble j holds j.
WORD = 0x76543210


def _reader(tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def read(name: str, part: Part) -> torch.Tensor:
        t = tensors[name]
        return t if part.dim is None else t.narrow(part.dim, part.start, part.stop - part.start)
    return read


def test_one_word_of_each_int4_layout() -> None:
    """compressed-tensors: column i at bits 4 (i % 8), stored q + 8; GPTQ: input row 8r + j
    at bits 4j, zeros stored minus one; AWQ: nibble i is column [0,2,4,6,1,3,5,7][i]."""
    word = torch.tensor([[WORD]], dtype=torch.int32)
    one = torch.ones(1, 1)
    ct = read_linear(QuantConfig("ct-w4a16", group_size=0), _reader({
        "m.weight_packed": word, "m.weight_scale": one, "m.weight_shape": torch.tensor([1, 8])}),
        "m", Part(), 1)
    assert isinstance(ct, Int4Weight)
    assert ct.dequantize(torch.float32).tolist() == [[j - 8.0 for j in range(8)]]
    gptq = read_linear(QuantConfig("gptq", group_size=0), _reader({
        "m.qweight": word.expand(1, 8).contiguous(), "m.scales": torch.ones(1, 8),
        "m.qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
        "m.g_idx": torch.zeros(8, dtype=torch.int32)}), "m", Part(), 8)
    # W[out n, in 8r + j] = j - 8 for every output n.
    assert gptq.dequantize(torch.float32)[3].tolist() == [j - 8.0 for j in range(8)]
    awq = read_linear(QuantConfig("awq", group_size=0), _reader({
        "m.qweight": word, "m.scales": torch.ones(1, 8),
        "m.qzeros": torch.zeros(1, 1, dtype=torch.int32)}), "m", Part(), 8)
    # W[out 8c + order[i], in 0] = i: column 2 holds nibble 1, column 1 nibble 4.
    assert awq.dequantize(torch.float32)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_gptq_act_order_in_g_idx_is_refused() -> None:
    g_idx = torch.arange(64, dtype=torch.int32).flip(0) // 32
    tensors = {"m.qweight": torch.zeros(8, 8, dtype=torch.int32),
               "m.qzeros": torch.zeros(2, 1, dtype=torch.int32), "m.scales": torch.ones(2, 8),
               "m.g_idx": g_idx}
    with pytest.raises(ValueError, match="m.g_idx is not i // group_size: act-order"):
        read_linear(QuantConfig("gptq", group_size=32), _reader(tensors), "m", Part(), 8)


def test_fp8_block_scales_follow_a_rank_s_rows_inside_a_block() -> None:
    q = (torch.randn(10, 6) * 8).to(FP8)
    s = torch.tensor([[1.0, 2.0], [4.0, 8.0], [16.0, 32.0]])  # blocks of 4 rows, 4 columns
    read = _reader({"m.weight": q[3:9], "m.weight_scale_inv": s[0:3]})
    cfg = QuantConfig("fp8-block", block=(4, 4))
    part = read_linear(cfg, lambda n, p: read(n, Part()), "m", Part(0, 3, 9), 10)
    whole = Fp8Weight(q, s.repeat_interleave(4, 0)[:10], 4).dequantize(torch.float32)
    assert torch.equal(part.dequantize(torch.float32), whole[3:9])


def test_int4_kernel_and_fp8_scaled_mm_match_the_dequantized_matmul() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=gen)
    w4 = Int4Weight(torch.randint(0, 16, (64, 256), generator=gen, dtype=torch.uint8),
                    torch.randint(0, 16, (64, 2), generator=gen).float(),
                    torch.rand(64, 2, generator=gen), 128)
    want = x @ w4.dequantize(torch.float32).t()
    kernel = QuantLinear(w4, torch.float32)
    assert kernel.mode == "int4-cpu"
    torch.testing.assert_close(kernel.forward(x), want, rtol=1e-5, atol=1e-4)
    fallback = QuantLinear(w4, torch.float32, kernels=False)
    assert fallback.mode == "dequantize" and fallback.nbytes < 64 * 256
    torch.testing.assert_close(fallback.forward(x), want, rtol=1e-5, atol=1e-4)
    # The CUDA FP8 path's math (torch._scaled_mm runs row-wise scales on the CPU too).
    q8 = (torch.randn(64, 256, generator=gen) * 32).to(FP8)
    scale = torch.rand(64, 1, generator=gen) / 64
    ref = x @ Fp8Weight(q8, scale, 256).dequantize(torch.float32).t()
    got = fp8_rowwise_mm(x, q8.t(), scale.view(1, -1))
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


def _published(root: Path, fmt: str, scale_dtype: torch.dtype) -> tuple[str, str]:
    src = make_tiny_checkpoint(root, "qwen3", tokenizer=False, seed=3, hidden_size=128,
                               intermediate_size=256, head_dim=32)
    return quantize(src, root, fmt, group=128, block=(128, 128), scale_dtype=scale_dtype,
                    published=True)


@pytest.mark.parametrize("fmt, scale_dtype", [
    *[(f, torch.bfloat16) for f in FORMATS], ("fp8-block", torch.float32)],
    ids=[*FORMATS, "fp8-block-float32-scales"])
def test_published_layouts_equal_hf(tmp_path: Path, fmt: str, scale_dtype: torch.dtype
                                    ) -> None:
    quant, ref = _published(tmp_path, fmt, scale_dtype)
    stored = load_file(f"{quant}/model.safetensors")
    scales = [t for n, t in stored.items() if "scale" in n and "shape" not in n]
    assert scales and all(t.dtype in (scale_dtype, torch.float16) for t in scales)
    for t in scales:
        assert_pow2(t)
    model = load_model(quant, torch.float32, CPU)
    driver = PagedDriver(model, num_blocks=40, block_size=16, seed=1)
    prompts = random_prompts([3, 45], 512, seed=4)
    out = driver.generate([driver.new_seq(p) for p in prompts], 16)
    assert out == [hf_greedy(ref, p, 16) for p in prompts]


def _edit(path: str, fn) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(f"{path}/model.safetensors")
    fn(tensors)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


def test_unexpected_quantization_tensors_are_an_error(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False, seed=1)
    quant, _ = quantize(src, tmp_path, "ct-fp8")
    _edit(quant, lambda t: t.update({"model.layers.0.self_attn.q_proj.input_scale":
                                     torch.ones(1)}))
    with pytest.raises(ValueError, match="unexpected quantization tensor "
                       "'model.layers.0.self_attn.q_proj.input_scale'.*ct-fp8"):
        load_model(quant, torch.float32, CPU)


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    """What the issue saw: e4m3 weights read as floats, scales skipped with a warning."""
    src = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False, seed=1)
    quant, _ = quantize(src, tmp_path, "fp8-block")
    cfg = json.loads(Path(quant, "config.json").read_text())
    del cfg["quantization_config"]
    Path(quant, "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unexpected quantization tensor .*weight_scale_inv.*"
                       "config.json has no quantization_config"):
        load_model(quant, torch.float32, CPU)
    _edit(quant, lambda t: [t.pop(n) for n in list(t) if n.endswith("_scale_inv")])
    with pytest.raises(ValueError, match="stored as F8_E4M3, not as floats: config.json has "
                       "no quantization_config"):
        load_model(quant, torch.float32, CPU)


def test_a_scale_of_the_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False, seed=1)
    quant, _ = quantize(src, tmp_path, "gptq", group=32)
    _edit(quant, lambda t: t.update({"model.layers.1.mlp.down_proj.scales":
                                     torch.ones(2, 64, dtype=torch.float16)}))
    with pytest.raises(ValueError, match="unexpected shape for weight "
                       "'model.layers.1.mlp.down_proj.scales'"):
        load_model(quant, torch.float32, CPU)


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq"])
def test_dummy_weights_with_a_quantization_config_are_quantized(tmp_path: Path, fmt: str
                                                                ) -> None:
    """`--load-format dummy` on a quantized model's config.json runs the format's kernels
    and holds its bytes (what `scripts/gpu-check` serves), rather than a float model."""
    from tandem_serve.gpu_worker.models.loader import weight_bytes
    from tests.gpu_worker.quant_utils import quant_config

    src = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False, seed=1)
    cfg = json.loads(Path(src, "config.json").read_text())
    plain = load_model(src, torch.float32, CPU, load_format="dummy", keep_quantized=True)
    cfg["quantization_config"] = quant_config(fmt, 32, (128, 128), published=True)
    Path(src, "config.json").write_text(json.dumps(cfg))
    model = load_model(src, torch.float32, CPU, load_format="dummy", keep_quantized=True)
    modes = {q.mode for layer in model.layers for q in layer.quant.values()}
    assert modes == ({"dequantize"} if fmt == "fp8-block" else {"int4-cpu"})
    assert weight_bytes(model) < weight_bytes(plain)
    driver = PagedDriver(model, num_blocks=8, block_size=16, seed=1)
    logits = driver.prefill([(driver.new_seq([1, 5, 9]), 3)])
    assert torch.isfinite(logits).all()
