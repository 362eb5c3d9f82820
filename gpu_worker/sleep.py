"""Sleep, wake-up and weight reload of a rank's model runner (the rollout controls).

Every rank runs the same operation (rank 0 forwards it first, as it does plans), on its own
shard.  The scheduler sends these only once no request is running, behind every plan sent
before (`scheduler/control.py`), so no plan ever sees a freed cache or half-loaded weights.

* sleep(1): the KV cache is freed; the weights stay in host memory (on a CUDA device they are
  moved there; on the CPU they already are).  sleep(2): the weights are freed too.
* wake_up(): the weights come back (after level 2 read again from the folder last loaded,
  or from the one `load_weights` named while asleep), the KV cache is allocated again
  (zeroed), and on CUDA the graphs are captured again: their buffers moved.
* load_weights(DIR): a checkpoint of the same architecture and shapes is read (this rank's
  shard of it) and copied into the model's own tensors in place, so everything that holds
  them (graphs, the executor, adapters' base) sees the new values.  While asleep it is read
  into host memory and moves to the device on wake-up.

Tensors are emptied and refilled through `.data`, never replaced: the executor, the attention
backend and the graphs keep references to the same tensor objects.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from tandem_serve.gpu_worker.models.loader import load_model
from tandem_serve.proto.control_messages import ControlDone, EngineControl

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.runner import ModelRunner

log = logging.getLogger("tandem.gpu_worker")

HOST = torch.device("cpu")


def rss_mib() -> float:
    """This process's resident memory (MiB), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _give_back_freed_memory(device: torch.device) -> None:
    """Return what was freed to the system: the CUDA caching allocator's blocks, and on the
    CPU glibc's heap (the worker keeps freed memory there while serving, `build.py`)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class SleepMode:
    """A rank's sleep level and the weights' folder, and the operations that change them."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.level = 0  # 0: awake
        self.model_dir = runner.model_dir  # where the weights held now came from
        self.weights_on_host = False  # asleep with weights read while asleep (or level 1)
        self._kv_shapes: list[tuple[torch.Size, torch.Size]] = []
        self._shapes: dict[str, torch.Size] = {}  # the weights' shapes while dropped

    def handle(self, msg: EngineControl) -> ControlDone:
        """Run one control; a failure is the answer's error, the worker keeps serving."""
        t0 = time.monotonic()
        before = rss_mib()
        try:
            if msg.op == "sleep":
                self.sleep(msg.level)
            elif msg.op == "wake_up":
                self.wake_up()
            elif msg.op == "load_weights":
                self.load_weights(msg.path)
            else:
                raise ValueError(f"unknown control {msg.op!r}")
        except (ValueError, OSError, RuntimeError) as exc:
            log.warning("%s failed: %s", msg.op, exc)
            return ControlDone(msg.seq, error=str(exc), seconds=time.monotonic() - t0)
        seconds = time.monotonic() - t0
        detail = f"rss_mib {before:.1f} -> {rss_mib():.1f}"
        log.info("%s%s done in %.2f s (%s)", msg.op, f"({msg.level})" if msg.op == "sleep"
                 else "", seconds, detail)
        return ControlDone(msg.seq, seconds=seconds, detail=detail)

    # ------------------------------------------------------------------ the operations

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.level:
            if level <= self.level:
                return  # already as deep asleep
            self._drop_weights()  # 1 -> 2
            self.level = 2
            return
        self._check_plain()
        runner = self.runner
        self._kv_shapes = [(k.shape, v.shape) for k, v in runner.kv_caches]
        for k, v in runner.kv_caches:
            k.data = torch.empty(0, dtype=k.dtype, device=k.device)
            v.data = torch.empty(0, dtype=v.dtype, device=v.device)
        if level == 1:
            self._move_weights(HOST)
            self.weights_on_host = True
        else:
            self._drop_weights()
        self.level = level
        _give_back_freed_memory(runner.device)

    def wake_up(self) -> None:
        if not self.level:
            return
        runner = self.runner
        if not self.weights_on_host:  # level 2, nothing loaded since: read the folder again
            self._assign(self._read(self.model_dir, HOST))
        self._move_weights(runner.device)
        if runner.onednn:
            runner.model.pack_weights()
        for (k, v), (k_shape, v_shape) in zip(runner.kv_caches, self._kv_shapes, strict=True):
            k.data = torch.zeros(k_shape, dtype=k.dtype, device=runner.device)
            v.data = torch.zeros(v_shape, dtype=v.dtype, device=runner.device)
        self.level, self.weights_on_host = 0, False
        runner.recapture_graphs()

    def load_weights(self, path: str) -> None:
        if not path or not os.path.isdir(path):
            raise ValueError(f"path: {path!r} is not a folder")
        self._check_plain()
        runner = self.runner
        if self.level:  # into host memory; wake-up moves them to the device
            self._assign(self._read(path, HOST))
            self.weights_on_host = True
        else:  # read on the host: the device never holds two copies of the weights
            fresh = self._read(path, HOST)
            with torch.no_grad():
                for name, tensor in self._tensors().items():
                    tensor.copy_(fresh[name])
            if runner.onednn:
                runner.model.pack_weights()
        self.model_dir = path
        _give_back_freed_memory(runner.device)

    # ------------------------------------------------------------------ helpers

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters (a tied head once) and buffers, by name."""
        model = self.runner.model
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def _check_plain(self) -> None:
        if self.runner.model.config.quant is not None:
            raise ValueError("sleep and load_weights need a float checkpoint; this model's "
                             "linears are quantized")

    def _read(self, path: str, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's shard of the checkpoint in `path`, checked against the model's names
        and shapes (a ValueError naming the first that differs)."""
        runner = self.runner
        fresh = load_model(path, runner.dtype, device, onednn=False, shard=runner.shard)
        have = {n: t.shape for n, t in self._tensors().items()}
        if self.level == 2:  # emptied: the shapes to compare are the kept ones
            have = self._shapes
        found = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
        for name, shape in have.items():
            if name not in found:
                raise ValueError(f"path: {path} has no tensor for {name} (another "
                                 f"architecture than the model served)")
            if found[name].shape != shape:
                raise ValueError(f"path: {path}: {name} has shape {tuple(found[name].shape)}, "
                                 f"the model served has {tuple(shape)}")
        return {n: found[n].detach() for n in have}

    def _assign(self, fresh: dict[str, torch.Tensor]) -> None:
        for name, tensor in self._tensors().items():
            tensor.data = fresh[name]

    def _move_weights(self, device: torch.device) -> None:
        for tensor in self._tensors().values():
            if tensor.device != device:
                tensor.data = tensor.data.to(device)

    def _drop_weights(self) -> None:
        self._shapes = {n: t.shape for n, t in self._tensors().items()}
        for tensor in self._tensors().values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.runner.model.unpack_weights()
        self.weights_on_host = False
        _give_back_freed_memory(self.runner.device)
