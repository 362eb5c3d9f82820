"""Building a gpu worker rank's model and KV cache from the server's configuration.

Apart from the process mains because every rank builds the same way: rank 0
(`gpu_worker.main`) and the other tensor-parallel ranks (`gpu_worker.follower`) both call
`build_runner`, and neither imports the other for it.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.ipc.process import StartupError, worker_threads
from tandem_serve.proto.config import ServerConfig

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
        return ModelRunner(cfg.model, device=cfg.device, dtype=cfg.dtype,
                           block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks,
                           kv_cache_memory=cfg.kv_cache_memory,
                           max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                           cuda_graphs=not cfg.enforce_eager, onednn=cfg.onednn,
                           flash_attn=cfg.flash_attn, tp=tp, adapter_cache=cfg.adapter_cache,
                           max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                           load_format=cfg.load_format)
    except ValueError as exc:  # the loader names the tensor, shape or setting it cannot use
        raise StartupError(f"--model {cfg.model!r}: {exc}") from exc
