"""Building a gpu worker rank's model and KV cache from the server's configuration.

Apart from the process mains because every rank builds the same way: rank 0
(`gpu_worker.main`) and the other tensor-parallel ranks (`gpu_worker.follower`) both call
`build_runner`, and neither imports the other for it.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING

import torch

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.ipc.process import StartupError, worker_threads
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.speculative import parse_speculative

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.parallel import TensorParallel

log = logging.getLogger("tandem.gpu_worker")


def build_runner(cfg: ServerConfig, tp: TensorParallel | None = None) -> ModelRunner:
    """The model and its KV cache; a checkpoint or device we cannot serve is a StartupError."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise StartupError(f"--device cuda: no CUDA device is available (torch "
                           f"{torch.__version__}, {build}); use --device cpu or auto")
    threads = worker_threads(cfg, tp.local_rank if tp else 0)
    if threads:
        torch.set_num_threads(threads)
    pinned = list(os.sched_getaffinity(0)) if cfg.worker_cpus else []
    log.info("torch threads: %d%s", torch.get_num_threads(),
             f", pinned to cores {pinned}" if pinned else "")
    try:
        runner = ModelRunner(cfg.model, device=cfg.device, dtype=cfg.dtype,
                             block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks,
                             kv_cache_memory=cfg.kv_cache_memory,
                             kv_cache_dtype=cfg.kv_cache_dtype,
                             max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                             cuda_graphs=not cfg.enforce_eager, onednn=cfg.onednn,
                             flash_attn=cfg.flash_attn,
                             attention_backend=cfg.attention_backend, tp=tp,
                             adapter_cache=cfg.adapter_cache, max_loras=cfg.max_loras,
                             max_lora_rank=cfg.max_lora_rank, load_format=cfg.load_format,
                             speculative=parse_speculative(cfg.speculative_config))
    except ValueError as exc:  # the loader names the tensor, shape or setting it cannot use
        raise StartupError(f"--model {cfg.model!r}: {exc}") from exc
    if runner.device.type == "cpu":
        keep_freed_memory()
    return runner


def keep_freed_memory() -> None:
    """CPU device: allocations up to 32 MiB come from the heap and freed memory stays there.

    A step allocates and frees buffers of a few MB every layer (a decode row's gathered
    context, a prefill piece's activations).  glibc serves those with a fresh mmap each
    time, so every call pays a page fault per 4 KiB it touches, then a munmap: measured, a
    decode step of 4 short rows and one 1,000-token row took 30 ms instead of 13, nearly all
    of it in the gather's page faults.  The price is resident memory held at the worker's
    peak, which it reaches again at its next busy step anyway.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
    log.info("heap allocations for buffers up to 32 MiB: %s", "on" if ok else "refused")
