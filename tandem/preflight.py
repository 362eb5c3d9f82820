"""Start-up checks the launcher makes before it starts any process.

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
import socket
from typing import Any

from adapters.peft import ModelShapes
from ipc.process import StartupError
from proto.config import ServerConfig
from rpc.adapter_store import AdapterStore
from tokenization.tokenizer import Tokenizer, TokenizerLoadError

CHECKPOINT_FILES = "config.json, *.safetensors and tokenizer.json"


def check_model(model: str) -> dict[str, Any]:
    """The model folder's config.json, once it is known to describe a model we serve."""
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
    from gpu_worker.models.config import ModelArgs

    try:
        ModelArgs.from_hf_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"config.json lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StartupError(f"--model {model!r}: {detail}") from None
    return config


def adapter_store(cfg: ServerConfig, config: dict[str, Any]) -> AdapterStore | None:
    """The frontend's adapter validator, sized from the model's config (None: adapters off)."""
    if not cfg.adapter_cache:
        return None
    if not os.path.isdir(cfg.adapter_cache):
        raise StartupError(f"--adapter-cache {cfg.adapter_cache!r} is not a folder; expected "
                           "the folder holding one PEFT adapter folder per adapter id")
    from gpu_worker.models.config import ModelArgs

    shapes = ModelShapes.of(ModelArgs.from_hf_config(config))
    return AdapterStore(cfg.adapter_cache, shapes, cfg.max_lora_rank)


def load_tokenizer(model: str) -> Tokenizer:
    try:
        return Tokenizer.from_dir(model)
    except TokenizerLoadError as exc:
        raise StartupError(f"--model {model!r}: {exc}") from None


def check_port(flag: str, host: str, port: int) -> None:
    """Fail now when `host:port` cannot be listened on (taken, or not an address of ours)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise StartupError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        # As servers bind: a port in TIME_WAIT after a restart is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise StartupError(f"{flag} {port}: cannot listen on {host}:{port} "
                               f"({exc.strerror}); choose a free port") from None


def check_ports(cfg: ServerConfig) -> None:
    for flag, port in (("--port", cfg.port), ("--metrics-port", cfg.metrics_port)):
        check_port(flag, cfg.host, port)
