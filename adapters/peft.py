"""A PEFT LoRA adapter folder: id rules, adapter_config.json, the safetensors header.

`read_adapter(cache_dir, adapter_id, shapes, max_rank)` answers, without torch and without
reading any weight data, either an `AdapterError` naming the adapter and the reason, or a
`LoraAdapter`: which (layer, module) pairs it adapts, with which rank and scaling, under
which tensor names.  The frontend turns the error into INVALID_ARGUMENT; the gpu worker
loads the named tensors into a slot.

Scaling follows PEFT: `lora_alpha / r` (`alpha / sqrt(r)` with `use_rslora`), where a
module's r and alpha come from `rank_pattern` / `alpha_pattern` when a pattern matches its
name (PEFT's `get_pattern_key`: the first key that matches the end of the name, at a dot).
The ranks in the weights file must agree with the config's.
"""
from __future__ import annotations

import heapq
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Protocol

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADDED_TOKENS_FILE = "added_tokens.json"

# The TGIS adapter's rule (vllm-tgis-adapter): no dots, so no "..", and no other punctuation.
ADAPTER_ID = re.compile(r"[/\w\-]+")

# Module name -> its parent in a Llama-family decoder layer.
MODULES: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
    "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
# What PEFT can also target in these models and we cannot adapt (new embeddings or head).
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")

# Settings that change the math beyond B·A·x·scaling (or add weights): rejected when set.
_UNSUPPORTED_SETTINGS: dict[str, str] = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication)",
    "lora_bias": "LoRA biases (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "target_parameters": "parameter targets (target_parameters)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}

# A VL model's language model nests its layers (`model.language_model.layers...`).
_KEY = re.compile(r"(?:base_model\.model\.)?model\.(?:language_model\.)?layers\.(\d+)\.(\w+)"
                  r"\.(\w+)\.lora_([AB])\.weight")
_FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_MAX_HEADER = 100 << 20  # bytes; a longer header is not a LoRA adapter


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it and says why."""

    def __init__(self, adapter_id: str, reason: str) -> None:
        super().__init__(f"adapter {adapter_id!r}: {reason}")
        self.adapter_id = adapter_id
        self.reason = reason


class _Dims(Protocol):
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class ModelShapes:
    """The served model's adaptable linear layers: (out_features, in_features) per module."""

    num_layers: int
    vocab_size: int
    linears: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, args: _Dims) -> ModelShapes:
        """From a decoder's dimensions (`gpu_worker.models.config.ModelArgs`, torch-free)."""
        h, i, d = args.hidden_size, args.intermediate_size, args.head_dim
        q, kv = args.num_heads * d, args.num_kv_heads * d
        # A gated attention's q_proj (Qwen3-Next, Qwen3.5) also yields the output gate.
        gated = 2 if getattr(args, "attn_output_gate", False) else 1
        return cls(args.num_layers, args.vocab_size, {
            "q_proj": (gated * q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)})


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: delta = scaling * B @ A @ x."""

    layer: int
    module: str  # q_proj, ..., down_proj
    rank: int
    scaling: float
    a_key: str  # tensor names in adapter_model.safetensors
    b_key: str


@dataclass(frozen=True)
class LoraAdapter:
    adapter_id: str
    folder: str
    rank: int  # the largest rank of any module
    modules: tuple[LoraModule, ...]

    @property
    def weights_path(self) -> str:
        return os.path.join(self.folder, WEIGHTS_FILE)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(m for m in MODULES if any(x.module == m for x in self.modules))


# ------------------------------------------------------------------------------- ids


def adapter_folder(cache_dir: str, adapter_id: str) -> str:
    """The adapter's folder (a real path inside the cache), or AdapterError."""
    if not ADAPTER_ID.fullmatch(adapter_id):
        raise AdapterError(adapter_id, "ids may only hold letters, digits, '_', '-' and '/'")
    if adapter_id.startswith("/"):
        raise AdapterError(adapter_id, "ids are paths relative to the adapter cache, not "
                                       "absolute paths")
    root = os.path.realpath(cache_dir)
    path = os.path.realpath(os.path.join(root, adapter_id))
    if path == root or os.path.commonpath([root, path]) != root:
        raise AdapterError(adapter_id, "names a folder outside the adapter cache")
    if not os.path.isdir(path):
        raise AdapterError(adapter_id, "not found in the adapter cache")
    return path


def find_adapters(cache_dir: str, limit: int = 256, max_folders: int = 4096) -> list[str]:
    """Ids of the folders under the cache that hold an adapter_config.json: the first `limit`
    by id, among the first `max_folders` folders by id (so a huge or deep cache costs a
    bounded walk).  Adapter folders are not entered, symlinks not followed, and names an id
    cannot hold (dots: hidden folders, versions) skipped.  Whether each one can be served is
    `read_adapter`'s question."""
    found: list[str] = []
    # A folder's id is a prefix of its descendants' ids: popping the smallest id visits the
    # folders in the order of their ids.
    heap = [""]
    visited = 0
    while heap and len(found) < limit and visited < max_folders:
        rel = heapq.heappop(heap)
        visited += 1
        if rel and os.path.isfile(os.path.join(cache_dir, rel, CONFIG_FILE)):
            found.append(rel)
            continue
        try:
            with os.scandir(os.path.join(cache_dir, rel)) as it:
                names = [e.name for e in it
                         if e.is_dir(follow_symlinks=False) and ADAPTER_ID.fullmatch(e.name)]
        except OSError:
            continue
        for name in names:
            heapq.heappush(heap, f"{rel}/{name}" if rel else name)
    return found


def folder_stamp(folder: str) -> tuple[int, ...] | None:
    """What changes when the adapter's files do (mtimes and sizes); None if one is missing."""
    out: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE, ADDED_TOKENS_FILE):
        try:
            st = os.stat(os.path.join(folder, name))
        except FileNotFoundError:
            if name == ADDED_TOKENS_FILE:
                out += [0, -1]
                continue
            return None
        except OSError:
            return None
        out += [st.st_mtime_ns, st.st_size]
    return tuple(out)


# ------------------------------------------------------------------------------- reading


def read_adapter(cache_dir: str, adapter_id: str, shapes: ModelShapes,
                 max_rank: int) -> LoraAdapter:
    """Everything the server needs to know about an adapter, or AdapterError.

    An absolute `adapter_id` is a folder of its own, loaded at runtime
    (`/v1/load_lora_adapter`; the frontend makes such ids, clients cannot: `adapter_folder`
    refuses them), read wherever it is."""
    if os.path.isabs(adapter_id):
        return read_adapter_folder(adapter_id, shapes, max_rank)
    return _read(adapter_id, adapter_folder(cache_dir, adapter_id), shapes, max_rank)


def read_adapter_folder(folder: str, shapes: ModelShapes, max_rank: int) -> LoraAdapter:
    """An adapter outside the cache, loaded at runtime: its id is its folder's real path, so
    the engine's slots and prefix-cache salts never mix it with another folder."""
    real = os.path.realpath(folder)
    if not os.path.isdir(real):
        raise AdapterError(folder, "no such folder")
    return _read(real, real, shapes, max_rank)


def _read(adapter_id: str, folder: str, shapes: ModelShapes, max_rank: int) -> LoraAdapter:
    config = _read_config(adapter_id, folder)
    _check_config(adapter_id, config, shapes)
    _check_added_tokens(adapter_id, folder, shapes.vocab_size)
    header = read_safetensors_header(adapter_id, os.path.join(folder, WEIGHTS_FILE))
    modules = _modules(adapter_id, config, header, shapes, max_rank)
    return LoraAdapter(adapter_id, folder, max(m.rank for m in modules), modules)


def _read_config(adapter_id: str, folder: str) -> dict[str, Any]:
    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(adapter_id, f"its folder has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(adapter_id, f"cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(adapter_id, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(adapter_id: str, config: dict[str, Any], shapes: ModelShapes) -> None:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(adapter_id, f"peft_type is {kind!r}; only LORA adapters are "
                                       "supported")
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if config.get(key):
            raise AdapterError(adapter_id, f"uses {what}, which this server does not support")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(adapter_id, f"trains biases (bias={bias!r}), which this server "
                                       "does not support")
    _check_targets(adapter_id, config.get("target_modules"), shapes)
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(adapter_id, f"{key} must be an object")


def _check_targets(adapter_id: str, targets: Any, shapes: ModelShapes) -> None:
    """Every configured target must be one of the model's adaptable linear layers."""
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):  # PEFT: a regex matched against whole module names
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterError(adapter_id, f"target_modules is not a valid regex: {exc}"
                               ) from None
        for name in ("model.embed_tokens", "lm_head"):
            if pattern.fullmatch(name):
                raise AdapterError(adapter_id, f"target_modules matches {name}, which this "
                                               "server cannot adapt")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(adapter_id, "target_modules must be a list of names or a regex")
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in _UNSUPPORTED_TARGETS:
            raise AdapterError(adapter_id, f"targets {target} (new embeddings or LM head), "
                                           "which this server does not support")
        if leaf not in shapes.linears:
            raise AdapterError(adapter_id, f"targets {target!r}, which the model does not "
                                           f"have; it has {', '.join(shapes.linears)}")


def _check_added_tokens(adapter_id: str, folder: str, vocab_size: int) -> None:
    path = os.path.join(folder, ADDED_TOKENS_FILE)
    if not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            added = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(adapter_id, f"cannot read {ADDED_TOKENS_FILE}: {exc}") from None
    ids = [v for v in added.values() if isinstance(v, int)] if isinstance(added, dict) else []
    new = [i for i in ids if i >= vocab_size]
    if new:
        raise AdapterError(adapter_id, f"adds {len(new)} tokens beyond the model's vocabulary "
                                       f"of {vocab_size} ({ADDED_TOKENS_FILE}); new token "
                                       "embeddings are not supported")


def read_safetensors_header(adapter_id: str, path: str) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape), after checking every tensor lies inside the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError("not a safetensors file (bad header length)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise AdapterError(adapter_id, f"its folder has no {WEIGHTS_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(adapter_id, f"cannot read {WEIGHTS_FILE}: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE}: the header is not a JSON object")
    data_size = size - 8 - length
    out: dict[str, tuple[str, list[int]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), [int(x) for x in entry["shape"]]
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise AdapterError(adapter_id, f"{WEIGHTS_FILE}: bad header entry {name!r}"
                               ) from None
        width = _FLOAT_DTYPES.get(dtype)
        if width is None:
            raise AdapterError(adapter_id, f"{WEIGHTS_FILE}: tensor {name} has dtype {dtype}; "
                                           "expected a float type")
        if not 0 <= start <= end <= data_size or end - start != math.prod(shape) * width:
            raise AdapterError(adapter_id, f"{WEIGHTS_FILE} is truncated or corrupt (tensor "
                                           f"{name})")
        out[name] = (dtype, shape)
    return out


# ------------------------------------------------------------------------------- layout


def pattern_key(patterns: dict[str, Any], name: str) -> str | None:
    """PEFT's `get_pattern_key`: the first pattern matching the end of `name` at a dot."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return key
        except re.error:
            continue
    return None


def _number(adapter_id: str, what: str, value: Any, integer: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not float(value).is_integer()) or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise AdapterError(adapter_id, f"{what} must be {kind}, got {value!r}")
    return float(value)


def _modules(adapter_id: str, config: dict[str, Any], header: dict[str, tuple[str, list[int]]],
             shapes: ModelShapes, max_rank: int) -> tuple[LoraModule, ...]:
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in header:
        m = _KEY.fullmatch(name)
        if m is None or m.group(3) not in MODULES or MODULES[m.group(3)] != m.group(2):
            raise AdapterError(adapter_id, f"{WEIGHTS_FILE} holds {name}, which is not a LoRA "
                                           "weight of a layer this server can adapt")
        layer = int(m.group(1))
        if layer >= shapes.num_layers:
            raise AdapterError(adapter_id, f"{WEIGHTS_FILE} holds {name}, but the model has "
                                           f"{shapes.num_layers} layers")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = name
    if not pairs:
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} holds no LoRA weights")
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    r_default = _number(adapter_id, "r", config.get("r", 8), integer=True)
    alpha_default = _number(adapter_id, "lora_alpha", config.get("lora_alpha", 8), False)
    out = []
    for (layer, module), keys in sorted(pairs.items()):
        if set(keys) != {"A", "B"}:
            missing = "lora_B" if "A" in keys else "lora_A"
            raise AdapterError(adapter_id, f"{WEIGHTS_FILE}: layer {layer} {module} has no "
                                           f"{missing} weight")
        full = f"model.layers.{layer}.{MODULES[module]}.{module}"
        r_key, a_key = pattern_key(ranks, full), pattern_key(alphas, full)
        r = int(_number(adapter_id, f"rank_pattern[{r_key!r}]", ranks[r_key], True)
                if r_key is not None else r_default)
        alpha = (_number(adapter_id, f"alpha_pattern[{a_key!r}]", alphas[a_key], False)
                 if a_key is not None else alpha_default)
        if r > max_rank:
            raise AdapterError(adapter_id, f"{full} has rank {r}, above this server's "
                                           f"--max-lora-rank {max_rank}")
        _check_shapes(adapter_id, header, keys, r, shapes.linears[module], full)
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        out.append(LoraModule(layer, module, r, scaling, keys["A"], keys["B"]))
    return tuple(out)


def _check_shapes(adapter_id: str, header: dict[str, tuple[str, list[int]]],
                  keys: dict[str, str], r: int, linear: tuple[int, int], full: str) -> None:
    out_features, in_features = linear
    for part, want in (("A", [r, in_features]), ("B", [out_features, r])):
        got = header[keys[part]][1]
        if got != want:
            raise AdapterError(adapter_id, f"{full}.lora_{part} has shape {got}; the model and "
                                           f"the adapter's rank {r} need {want}")
