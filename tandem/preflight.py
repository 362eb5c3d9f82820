"""Start-up checks the launcher makes before it starts any process (the frontend's ports:
frontend/ports.py).

A user's mistake (a model folder that does not exist or that Tandem cannot serve, a port
already taken) should cost one line naming the flag and what is expected, not a traceback
from whichever process trips over it first; `ipc.process.StartupError` carries that line to
`tandem` (exit status 2). These checks read files and try sockets only: no torch here, so
the frontend stays light. What only loading the weights can tell (a missing tensor, a
device that is not there) is reported the same way by the gpu worker.
"""
from __future__ import annotations

import json
import os
from typing import Any

from tandem_serve.adapters.peft import ModelShapes
from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.ipc.process import StartupError, available_host_bytes
from tandem_serve.pooling.folder import PoolingFolderError, PoolingSpec
from tandem_serve.proto.config import ServerConfig
from tandem_serve.tokenization.tokenizer import Tokenizer, TokenizerLoadError

CHECKPOINT_FILES = "config.json, *.safetensors and tokenizer.json"


def check_pooling_model(model: str) -> PoolingSpec:
    """`--runner pooling`: the folder's pooling spec, once it is one we serve."""
    if not os.path.isdir(model):
        what = "is a file, not a folder" if os.path.exists(model) else "does not exist"
        raise StartupError(f"--model {model!r} {what}; expected a sentence-transformers or "
                           f"cross-encoder folder")
    try:
        return PoolingSpec.read(model)
    except (PoolingFolderError, KeyError, TypeError, ValueError) as exc:
        detail = f"config.json lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StartupError(f"--model {model!r} (--runner pooling): {detail}") from None


def check_model(model: str, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """The model folder's config.json, once it is known to describe a model we serve (and,
    with tensor parallelism, one whose heads, MLP and vocabulary split over the ranks)."""
    if not os.path.isdir(model):
        what = "is a file, not a folder" if os.path.exists(model) else "does not exist"
        raise StartupError(f"--model {model!r} {what}; expected a Hugging Face checkpoint "
                           f"folder ({CHECKPOINT_FILES})")
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise StartupError(f"--model {model!r} has no config.json; expected a Hugging Face "
                           f"checkpoint folder ({CHECKPOINT_FILES})") from None
    except (OSError, ValueError) as exc:
        raise StartupError(f"--model {model!r}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict):
        raise StartupError(f"--model {model!r}: config.json is not a JSON object")
    # Parsing the config here (torch-free) names an unsupported architecture or rope type
    # before any process starts.
    from tandem_serve.gpu_worker.models.config import ModelArgs
    from tandem_serve.gpu_worker.models.quant.split import split_problems

    try:
        args = ModelArgs.from_hf_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"config.json lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StartupError(f"--model {model!r}: {detail}") from None
    problems = split_problems(args, tensor_parallel_size)
    if problems:
        raise StartupError(f"--model {model!r} cannot be split: {'; '.join(problems)}")
    return config


def check_hybrid(cfg: ServerConfig, config: dict[str, Any]) -> None:
    """What a hybrid linear-attention model cannot be served with yet (the gpu worker
    refuses it too): a speculative method other than n-gram, LoRA adapters under tensor
    parallelism, and the host KV tier."""
    from tandem_serve.gpu_worker.models.config import ModelArgs
    from tandem_serve.proto.speculative import parse_speculative

    args = ModelArgs.from_hf_config(config)
    if not args.is_hybrid:
        return
    spec = parse_speculative(cfg.speculative_config)
    if spec is not None and spec.method != "ngram":
        raise StartupError(f"--speculative-config: method {spec.method!r} is not supported for "
                           f"{args.architecture}: only 'ngram' (a draft model would need "
                           "linear-attention states of its own)")
    if cfg.adapter_cache and cfg.tensor_parallel_size > 1:
        raise StartupError(f"--adapter-cache: LoRA adapters under tensor parallelism are not "
                           f"supported for {args.architecture} yet")
    if cfg.kv_offloading_size > 0:
        raise StartupError(f"--kv-offloading-size is not supported for {args.architecture}: the "
                           "host tier keeps KV blocks, not the recurrent-state checkpoints a "
                           "prefix hit restores")


def adapter_store(cfg: ServerConfig, config: dict[str, Any]) -> AdapterStore | None:
    """The frontend's adapter validator, sized from the model's config (None: adapters off)."""
    if not cfg.adapter_cache:
        return None
    if not os.path.isdir(cfg.adapter_cache):
        raise StartupError(f"--adapter-cache {cfg.adapter_cache!r} is not a folder; expected "
                           "the folder holding one PEFT adapter folder per adapter id")
    from tandem_serve.gpu_worker.models.config import ModelArgs

    shapes = ModelShapes.of(ModelArgs.from_hf_config(config))
    return AdapterStore(cfg.adapter_cache, shapes, cfg.max_lora_rank)


def load_tokenizer(model: str) -> Tokenizer:
    try:
        return Tokenizer.from_dir(model)
    except TokenizerLoadError as exc:
        raise StartupError(f"--model {model!r}: {exc}") from None


def check_host_memory(cfg: ServerConfig) -> None:
    """`--kv-offloading-size` against this host's available memory, for the ranks it runs,
    before any process starts (the gpu worker checks again where it runs: under the compose
    roles that may be another host)."""
    wanted = cfg.kv_offloading_size * cfg.ranks_per_node / cfg.tensor_parallel_size
    free = available_host_bytes()
    if wanted * (1 << 30) > free:
        raise StartupError(f"--kv-offloading-size asks for {wanted:.2f} GiB of host memory on "
                           f"this host; it has {free / 2**30:.2f} GiB available: lower it")
