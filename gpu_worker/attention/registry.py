"""The attention backends by name, and the one choice of them a process makes at start-up.

A new backend is a module with an `AttentionBackend` subclass (`base`) and one line in
`BACKENDS`; `proto.config.ATTENTION_BACKENDS` lists the names the flag accepts (torch-free,
so a wrong name is refused before any process starts; a test keeps the two equal).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tandem_serve.gpu_worker.attention.base import AttentionBackend, WarmUp
from tandem_serve.gpu_worker.attention.flash import FlashBackend
from tandem_serve.gpu_worker.attention.flex import FlexBackend
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend
from tandem_serve.gpu_worker.attention.triton_attn import TritonBackend
from tandem_serve.ipc.process import StartupError

log = logging.getLogger(__name__)

# `--attention-backend NAME` -> its class; `auto` tries them in this order (sdpa, which
# serves everywhere, last).
BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash": FlashBackend,
    "triton": TritonBackend,
    "flex": FlexBackend,
    "sdpa": SdpaBackend,
}


# Why a backend without `bidirectional` cannot serve a model whose images need it.
NO_BIDIRECTIONAL = ("cannot attend both ways among an image's tokens, which Gemma 3's "
                    "vision prefill needs (sdpa and flex can)")


def check_backend(name: str, device: torch.device, dtype: torch.dtype,
                  kv_dtype: torch.dtype, block_size: int, bidirectional: bool = False
                  ) -> None:
    """A StartupError naming the flag, the backend and why, where a named backend cannot
    serve `device`, `dtype`, a `kv_dtype` cache or `block_size`, or a model whose images
    attend both ways (`bidirectional`; nothing for "auto"): cheap, so the runner asks
    before it loads any weight."""
    if name == "auto":
        return
    if name not in BACKENDS:
        raise StartupError(f"--attention-backend {name!r} is not one of auto, "
                           f"{', '.join(BACKENDS)}")
    reason = _refusal(BACKENDS[name], device, dtype, kv_dtype, block_size, bidirectional,
                      BACKENDS[name].supports)
    if reason is not None:
        raise StartupError(f"--attention-backend {name}: {reason}")


def _refusal(cls: type[AttentionBackend], device: torch.device, dtype: torch.dtype,
             kv_dtype: torch.dtype, block_size: int, bidirectional: bool,
             check: Callable[..., str | None]) -> str | None:
    if bidirectional and not cls.bidirectional:
        return NO_BIDIRECTIONAL
    return check(device, dtype, kv_dtype, block_size)


def select_backend(name: str, device: torch.device, dtype: torch.dtype,
                   kv_dtype: torch.dtype, block_size: int, *, flash_attn: bool = True,
                   warm_up: WarmUp | None = None, bidirectional: bool = False
                   ) -> AttentionBackend:
    """The backend this process attends with, for the whole of its life.

    `name`: a key of `BACKENDS`, or "auto": the first of them that serves `device`,
    `dtype`, a `kv_dtype` cache and `block_size` (`supports`), that `auto` does not pass
    over there (`auto_skips`; `flash_attn` False: never flash, `--no-flash-attn`) and whose
    start-up check (`warm_up`, when given: e.g. FlexAttention's compile) succeeds.  Every
    fallback is logged here, once.  A named backend that cannot serve (`check_backend`), or
    whose start-up check fails, is a StartupError naming the flag, the backend and why.
    `bidirectional`: the model's images attend both ways (Gemma 3): only backends that
    honour it serve."""
    check_backend(name, device, dtype, kv_dtype, block_size, bidirectional)
    if name != "auto":
        backend = BACKENDS[name]()
        reason = _warm_up(backend, warm_up)
        if reason is not None:
            raise StartupError(f"--attention-backend {name}: {reason}")
        log.info("attention backend: %s", name)
        return backend
    passed: list[str] = []
    for cls in BACKENDS.values():
        reason = _refusal(cls, device, dtype, kv_dtype, block_size, bidirectional,
                          cls.auto_skips)
        if reason is None and cls is FlashBackend and not flash_attn:
            reason = "--no-flash-attn"
        if reason is None:
            backend = cls()
            reason = _warm_up(backend, warm_up)
            if reason is None:
                log.info("attention backend: %s (auto%s)", cls.name,
                         f"; passed over {'; '.join(passed)}" if passed else "")
                return backend
            log.warning("attention backend %s failed its start-up check (%s); trying the "
                        "next", cls.name, reason)
        passed.append(f"{cls.name}: {reason}")
    raise StartupError(f"--attention-backend auto: no backend serves here ({'; '.join(passed)})")


def _warm_up(backend: AttentionBackend, probe: WarmUp | None) -> str | None:
    """None when the backend's start-up check passes (or there is none to run); else why."""
    if probe is None:
        return None
    try:
        backend.warm_up(probe)
    except torch.OutOfMemoryError:
        raise  # the device, not the backend: no other backend would fix it
    except Exception as exc:  # noqa: BLE001 - any compile failure: decided now, not mid-serving
        log.debug("%s start-up check", backend.name, exc_info=True)
        return f"start-up check failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None
