"""Choosing the attention backend (`gpu_worker.attention.registry`): what `auto` picks where
(the CPU: sdpa, as before backends had names; CUDA: flash where flash_attn serves, else
triton where Triton is installed, else flex), a named backend that cannot serve here as
one start-up error naming the flag, and a start-up check that fails: `auto` falls back then
and says so, a named backend refuses.
No GPU needed: `supports` only reads the device's type, and the checks are stand-ins."""
from __future__ import annotations

import logging

import pytest
import torch

from tandem_serve.gpu_worker.attention import flash
from tandem_serve.gpu_worker.attention.base import WarmUp
from tandem_serve.gpu_worker.attention.flash import FlashBackend
from tandem_serve.gpu_worker.attention.flex import FlexBackend
from tandem_serve.gpu_worker.attention.registry import BACKENDS, check_backend, select_backend
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend
from tandem_serve.gpu_worker.attention.triton_attn import TritonBackend
from tandem_serve.ipc.process import StartupError
from tandem_serve.proto.config import ATTENTION_BACKENDS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, FP8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn


def probe() -> WarmUp:
    cache = torch.zeros(2, 16, 1, 8)
    return WarmUp((cache, cache), 2, (None,), 0.5, F32)


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if Triton were not installed (the CUDA image brings it; a bare torch may not)."""
    monkeypatch.setattr(TritonBackend, "supports",
                        classmethod(lambda cls, *a: "triton is not installed"))


@pytest.fixture
def flash_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if flash_attn with paged varlen were importable (nothing calls it here)."""
    monkeypatch.setattr(flash, "_fa_varlen", object())
    monkeypatch.setattr(flash, "_fa_kvcache", object())


def test_the_flag_names_every_registered_backend() -> None:
    assert ATTENTION_BACKENDS == ("auto", *BACKENDS)
    assert all(cls.name == name for name, cls in BACKENDS.items())


@pytest.mark.parametrize("dtype, kv_dtype, block_size", [
    (F32, F32, 16), (F32, FP8, 16), (BF16, BF16, 256), (BF16, FP8, 4)])
def test_auto_on_the_cpu_is_sdpa(dtype: torch.dtype, kv_dtype: torch.dtype,
                                 block_size: int) -> None:
    """Mixed steps on the CPU always took the split path: eager FlexAttention materialises
    every score there."""
    assert type(select_backend("auto", CPU, dtype, kv_dtype, block_size)) is SdpaBackend
    assert FlexBackend.supports(CPU, dtype, kv_dtype, block_size) is None  # by name, it runs
    assert "CPU" in (FlexBackend.auto_skips(CPU, dtype, kv_dtype, block_size) or "")


@pytest.mark.parametrize("name, cls", [("sdpa", SdpaBackend), ("flex", FlexBackend)])
def test_a_named_backend_serves_the_cpu(name: str, cls: type) -> None:
    backend = select_backend(name, CPU, F32, FP8, 16, warm_up=probe())
    assert type(backend) is cls and backend.name == name


def test_auto_on_cuda_is_flash_where_it_serves_else_triton(flash_installed: None) -> None:
    """Triton reads the cache in place, as flash does, where flex's decode gathers it."""
    assert type(select_backend("auto", CUDA, BF16, BF16, 256)) is FlashBackend
    assert type(select_backend("auto", CUDA, BF16, FP8, 256)) is TritonBackend
    assert type(select_backend("auto", CUDA, BF16, BF16, 16)) is TritonBackend
    assert type(select_backend("auto", CUDA, F32, F32, 16, flash_attn=False)) is TritonBackend
    assert TritonBackend.auto_skips(CPU, F32, F32, 16) is not None  # the interpreter: tests


def test_auto_on_cuda_without_triton_is_flex_without_flash_attn_and_flash_with_it(
        flash_installed: None, no_triton: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(select_backend("auto", CUDA, BF16, BF16, 256)) is FlashBackend
    # --no-flash-attn, an fp8 cache, a float32 model or blocks flash_attn cannot page:
    assert type(select_backend("auto", CUDA, BF16, BF16, 256, flash_attn=False)) is FlexBackend
    assert type(select_backend("auto", CUDA, BF16, FP8, 256)) is FlexBackend
    assert type(select_backend("auto", CUDA, F32, F32, 256)) is FlexBackend
    assert type(select_backend("auto", CUDA, BF16, BF16, 16)) is FlexBackend
    monkeypatch.setattr(flash, "_fa_varlen", None)
    assert type(select_backend("auto", CUDA, BF16, BF16, 256)) is FlexBackend


@pytest.mark.parametrize("device, dtype, kv_dtype, block_size, why", [
    (CPU, BF16, BF16, 256, "CUDA only"),
    (CUDA, BF16, FP8, 256, "float16 or bfloat16 model and KV cache"),
    (CUDA, F32, F32, 256, "model float32"),
    (CUDA, BF16, BF16, 16, "multiples of 256 tokens (--block-size 16)"),
])
def test_flash_says_why_it_cannot_serve(flash_installed: None, device: torch.device,
                                        dtype: torch.dtype, kv_dtype: torch.dtype,
                                        block_size: int, why: str) -> None:
    assert why in (FlashBackend.supports(device, dtype, kv_dtype, block_size) or "")


def test_a_named_backend_that_cannot_serve_is_a_startup_error() -> None:
    """flash on the CPU (and here flash_attn is not even installed): one line naming the flag,
    the backend and why; `check_backend` says so before the runner loads any weight."""
    with pytest.raises(StartupError) as err:
        select_backend("flash", CPU, F32, F32, 16)
    with pytest.raises(StartupError) as early:
        check_backend("flash", CPU, F32, F32, 16)
    assert str(early.value) == str(err.value)
    check_backend("auto", CPU, F32, F32, 16)  # auto always finds one (sdpa serves anywhere)
    message = str(err.value)
    assert message.startswith("--attention-backend flash: ") and "\n" not in message
    assert "flash_attn" in message
    with pytest.raises(StartupError, match="--attention-backend 'nope' is not one of auto, "):
        select_backend("nope", CPU, F32, F32, 16)


def test_a_failed_start_up_check_falls_back_once_and_says_so(
        no_triton: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """FlexAttention's compile failing at start-up: auto takes sdpa then, logged; named, flex
    refuses to start.  Mixed steps never meet the failure."""
    def broken(self: FlexBackend, probe: WarmUp) -> None:
        raise RuntimeError("no C compiler\nsecond line")

    monkeypatch.setattr(FlexBackend, "warm_up", broken)
    with caplog.at_level(logging.INFO, "tandem_serve.gpu_worker.attention.registry"):
        chosen = select_backend("auto", CUDA, BF16, BF16, 16, warm_up=probe())
    assert type(chosen) is SdpaBackend
    logged = caplog.text
    assert "flex failed its start-up check" in logged and "no C compiler" in logged
    assert "attention backend: sdpa (auto; passed over" in logged
    with pytest.raises(StartupError) as err:
        select_backend("flex", CPU, F32, F32, 16, warm_up=probe())
    assert str(err.value) == ("--attention-backend flex: start-up check failed: RuntimeError: "
                              "no C compiler")


def test_running_out_of_memory_in_the_check_is_not_a_backend_failure(
        no_triton: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(self: FlexBackend, probe: WarmUp) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(FlexBackend, "warm_up", oom)
    with pytest.raises(torch.OutOfMemoryError):
        select_backend("auto", CUDA, BF16, BF16, 16, warm_up=probe())


def test_the_runner_attends_with_the_backend_it_chose(llama: str) -> None:
    from tests.gpu_worker.runner_driver import make_runner

    runner = make_runner(llama)
    assert type(runner.attention) is SdpaBackend and runner.model.attention is runner.attention
    with pytest.raises(StartupError, match="--attention-backend flash: "):
        make_runner(llama, attention_backend="flash")
