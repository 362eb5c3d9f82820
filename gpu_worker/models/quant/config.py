"""config.json's `quantization_config`: which of the five formats a checkpoint is stored in,
checked against what Tandem implements.

| kind | quant_method / format | weights |
|---|---|---|
| `fp8-block` | `fp8` (HF fine-grained) | e4m3 `weight` + `weight_scale_inv` per block |
| `ct-fp8` | `compressed-tensors`, `float-quantized` | e4m3 `weight` + `weight_scale` per row |
| `ct-w4a16` | `compressed-tensors`, `pack-quantized` | int4 `weight_packed` + `weight_scale` |
| `gptq` | `gptq` (v1 checkpoint format) | int4 `qweight`, `qzeros`, `scales`, `g_idx` |
| `awq` | `awq`, version `gemm` | int4 `qweight`, `qzeros`, `scales` |

Anything else (another method, bit width, group size, act-order, asymmetric int4, static
activation scales, a KV-cache scheme, sparsity, an `ignore` entry that cannot be read) is
a ValueError naming the key and its value, which start-up turns into one `error:` line.
Published checkpoints carry bookkeeping keys (GPTQ's `damp_percent`, `true_sequential`,
`model_name_or_path`...; AWQ's `zero_point`, `version`): keys that do not change how the
weights are stored are ignored; the ones that do are checked.

Torch-free: `gpu_worker.models.config` parses this into `ModelArgs.quant`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FP8_BLOCK = "fp8-block"
CT_FP8 = "ct-fp8"
CT_W4A16 = "ct-w4a16"
GPTQ = "gptq"
AWQ = "awq"
KINDS = (FP8_BLOCK, CT_FP8, CT_W4A16, GPTQ, AWQ)
INT4_KINDS = (CT_W4A16, GPTQ, AWQ)
# int4 group sizes accepted (the torch int4 kernel's sizes); 0 is per output channel.
GROUP_SIZES = (32, 64, 128, 0)
_ACCEPTED_GROUPS = "32, 64, 128 or -1 (per channel)"
_KEY = "quantization_config"


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's linear weights are stored (see the module table)."""

    kind: str
    # fp8-block: (output rows, input columns) of a scale block.
    block: tuple[int, int] = (0, 0)
    # int4: input columns per scale (0: one scale per output channel).
    group_size: int = 0
    # Modules left unquantized: substrings (fp8, gptq, awq: `modules_to_not_convert`) ...
    not_converted: tuple[str, ...] = ()
    # ... or compressed-tensors' `ignore`: names and "re:" patterns.
    ignore: tuple[str, ...] = ()

    @property
    def is_int4(self) -> bool:
        return self.kind in INT4_KINDS

    def quantized(self, module: str) -> bool:
        """Whether linear `module` ("model.layers.0.self_attn.q_proj") is stored quantized."""
        if self.kind in (CT_FP8, CT_W4A16):
            return not any(_ct_match(entry, module) for entry in self.ignore)
        return not any(_substring_match(entry, module) for entry in self.not_converted)


def _ct_match(entry: str, module: str) -> bool:
    # compressed-tensors: "re:<pattern>" is re.match'ed against the module's name.
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module


def _substring_match(entry: str, module: str) -> bool:
    # transformers' modules_to_not_convert: an entry names a module or a path around it.
    return entry == module or module.endswith("." + entry) or module.startswith(entry + ".") \
        or f".{entry}." in module


def parse(cfg: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's format from config.json (None: not quantized); ValueError naming
    the key and value Tandem does not implement."""
    q = cfg.get(_KEY)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{_KEY} must be an object, got {q!r}")
    method = q.get("quant_method")
    parsers = {"fp8": _fp8, "gptq": _gptq, "awq": _awq, "compressed-tensors": _ct}
    if method not in parsers:
        raise ValueError(f"{_KEY}.quant_method {method!r} is not supported; supported: "
                         f"{', '.join(parsers)}")
    return parsers[method](q)


def _refuse(key: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"{_KEY}.{key} {value!r} is not supported; supported: {accepted}")


def _expect(q: dict[str, Any], key: str, accepted: tuple[Any, ...], what: str) -> None:
    if q.get(key) not in accepted:
        raise _refuse(key, q.get(key), what)


def _names(q: dict[str, Any], key: str) -> tuple[str, ...]:
    value = q.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{_KEY}.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _fp8(q: dict[str, Any]) -> QuantConfig:
    _expect(q, "activation_scheme", ("dynamic",), "'dynamic' (static needs input_scale)")
    _expect(q, "fmt", (None, "e4m3"), "'e4m3'")
    if q.get("modules_to_convert") is not None:
        raise _refuse("modules_to_convert", q["modules_to_convert"], "null")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block,
                      "[rows, columns] of positive integers (per-tensor scales are not)")
    return QuantConfig(FP8_BLOCK, block=(block[0], block[1]),
                       not_converted=_names(q, "modules_to_not_convert"))


def _group(q: dict[str, Any], key: str) -> int:
    g = q.get(key)
    if g in (-1, None):
        return 0  # per output channel
    if g not in GROUP_SIZES or not g:
        raise _refuse(key, g, _ACCEPTED_GROUPS)
    return int(g)


def _gptq(q: dict[str, Any]) -> QuantConfig:
    _expect(q, "bits", (4,), "4")
    _expect(q, "sym", (True,), "true (GPTQ v1 cannot store a zero point of 0)")
    _expect(q, "desc_act", (False, None), "false (act-order is not supported)")
    _expect(q, "checkpoint_format", (None, "gptq"), "'gptq' (v1)")
    _expect(q, "format", (None, "gptq"), "'gptq' (v1)")
    _expect(q, "is_marlin_format", (None, False), "false")
    _expect(q, "lm_head", (None, False), "false (lm_head stays unquantized)")
    if q.get("modules_in_block_to_quantize") is not None:
        raise _refuse("modules_in_block_to_quantize", q["modules_in_block_to_quantize"],
                      "null (every linear layer quantized)")
    return QuantConfig(GPTQ, group_size=_group(q, "group_size"),
                       not_converted=_names(q, "modules_to_not_convert"))


def _awq(q: dict[str, Any]) -> QuantConfig:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    version = q.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise _refuse("version", version, "'gemm'")
    _expect(q, "zero_point", (None, True), "true")
    _expect(q, "format", (None, "gemm"), "'gemm'")
    key = "group_size" if "group_size" in q else "q_group_size"
    return QuantConfig(AWQ, group_size=_group(q, key),
                       not_converted=_names(q, "modules_to_not_convert"))


def _ct(q: dict[str, Any]) -> QuantConfig:
    """compressed-tensors: one config group targeting Linear, FP8 (dynamic per-token
    activations, per-channel weights) or W4A16 (symmetric, grouped or per
    channel)."""
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            raise _refuse(key, q[key], "null")
    _expect(q, "quantization_status", (None, "compressed", "frozen"), "'compressed'")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse("config_groups", groups, "one group")
    name, group = next(iter(groups.items()))
    if not isinstance(group, dict):
        raise _refuse(f"config_groups.{name}", group, "an object")
    if group.get("output_activations") is not None:
        raise _refuse(f"config_groups.{name}.output_activations",
                      group["output_activations"], "null")
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"config_groups.{name}.targets", group.get("targets"), '["Linear"]')
    fmt = group.get("format") or q.get("format")
    ignore = _names(q, "ignore")
    if not any(_ct_match(e, "lm_head") for e in ignore):
        raise _refuse("ignore", list(ignore), "a list naming lm_head (it stays unquantized)")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"config_groups.{name}.weights", weights, "an object")
    where = f"config_groups.{name}"
    if fmt == "float-quantized":
        _ct_fp8(weights, group.get("input_activations"), where)
        return QuantConfig(CT_FP8, ignore=ignore)
    if fmt == "pack-quantized":
        return QuantConfig(CT_W4A16, group_size=_ct_int4(weights, group, where), ignore=ignore)
    raise _refuse("format", fmt, "'float-quantized' (FP8) or 'pack-quantized' (W4A16)")


def _ct_fp8(weights: dict[str, Any], acts: Any, where: str) -> None:
    w = f"{where}.weights"
    _expect_at(weights, w, "num_bits", (8,), "8")
    _expect_at(weights, w, "type", ("float",), "'float'")
    _expect_at(weights, w, "symmetric", (True,), "true")
    _expect_at(weights, w, "strategy", ("channel",), "'channel'")
    _expect_at(weights, w, "dynamic", (False, None), "false")
    if not isinstance(acts, dict):
        raise _refuse(f"{where}.input_activations", acts,
                      "dynamic per-token FP8 (an object)")
    a = f"{where}.input_activations"
    _expect_at(acts, a, "num_bits", (8,), "8")
    _expect_at(acts, a, "type", ("float",), "'float'")
    _expect_at(acts, a, "dynamic", (True,), "true (static scales are not supported)")
    _expect_at(acts, a, "strategy", ("token",), "'token'")


def _ct_int4(weights: dict[str, Any], group: dict[str, Any], where: str) -> int:
    w = f"{where}.weights"
    _expect_at(weights, w, "num_bits", (4,), "4")
    _expect_at(weights, w, "type", ("int",), "'int'")
    _expect_at(weights, w, "symmetric", (True,), "true (asymmetric int4 is not supported)")
    _expect_at(weights, w, "dynamic", (False, None), "false")
    _expect_at(weights, w, "actorder", (None, False), "null (act-order is not supported)")
    if group.get("input_activations") is not None:
        raise _refuse(f"{where}.input_activations", group["input_activations"],
                      "null (weight-only)")
    strategy = weights.get("strategy")
    if strategy == "channel":
        return 0
    if strategy != "group":
        raise _refuse(f"{w}.strategy", strategy, "'group' or 'channel'")
    size = weights.get("group_size")
    if size not in GROUP_SIZES or size == 0:
        raise _refuse(f"{w}.group_size", size, "32, 64 or 128")
    return int(size)


def _expect_at(d: dict[str, Any], where: str, key: str, accepted: tuple[Any, ...],
               what: str) -> None:
    if d.get(key) not in accepted:
        raise _refuse(f"{where}.{key}", d.get(key), what)
