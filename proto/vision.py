"""Which vision-language checkpoints load, and the language model inside their config.json.

A VL folder's config.json nests the language model (`text_config`, what transformers 5
writes) or keeps its keys at the top level (the published Qwen2.5-VL checkpoints); either way
the decoder underneath is a family the gpu worker's `models.config` already serves, so this
module hands it the text model's keys under that family's architecture and keeps what the
vision side needs (`VisionSpec`): the frontend (placeholders, preprocessing) and the gpu
worker (tower, M-RoPE) read the same spec. Torch-free: the launcher and the frontend parse it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"
GEMMA3_VL = "Gemma3ForConditionalGeneration"
# Qwen3.5: Qwen3-VL's tower without DeepStack over the hybrid linear-attention language model,
# whose text config `gpu_worker.models.hybrid.config` reads (every Qwen3.5 is published so).
QWEN3_5_VL = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE_VL = "Qwen3_5MoeForConditionalGeneration"
_QWEN3_5 = (QWEN3_5_VL, QWEN3_5_MOE_VL)
# transformers' Qwen3.5 rotary: interleaved, these sections unless the config names them.
_QWEN3_5_SECTION: tuple[int, ...] = (11, 11, 10)
_QWEN3_5_IMAGE_TOKEN = 248056
# VL architecture -> the text architecture of its language model.
VL_ARCHITECTURES = {QWEN2_5_VL: "Qwen2ForCausalLM", QWEN3_VL: "Qwen3ForCausalLM",
                    QWEN3_VL_MOE: "Qwen3MoeForCausalLM", GEMMA3_VL: "Gemma3ForCausalLM",
                    QWEN3_5_VL: "Qwen3_5ForCausalLM", QWEN3_5_MOE_VL: "Qwen3_5MoeForCausalLM"}
_MODEL_TYPES = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL, "qwen3_vl_moe": QWEN3_VL_MOE,
                "qwen3_5": QWEN3_5_VL, "qwen3_5_moe": QWEN3_5_MOE_VL}
# Qwen3-VL-MoE's text config class defaults (transformers' `Qwen3VLMoeTextConfig`), which
# differ from Qwen3-MoE's: a config.json that leaves a key out means these.
_VL_MOE_DEFAULTS = {"num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                    "decoder_sparse_step": 1}
_VL_MOE_EXPERTS = 60
# A VL checkpoint's vision tensors: their prefix -> the tower module's own. Qwen: the tower
# is the module. Gemma 3: a SigLIP tower and a projector side by side, published with
# SigLIP's `vision_model.` level, which transformers 5 drops when it saves. The loader leaves
# these out of the language model, and `gpu_worker.vision.tower` loads them.
TOWER_PREFIXES = {"visual.": "", "model.visual.": "",
                  "vision_tower.vision_model.": "vision_tower.",
                  "vision_tower.": "vision_tower.",
                  "model.vision_tower.vision_model.": "vision_tower.",
                  "model.vision_tower.": "vision_tower.",
                  "multi_modal_projector.": "multi_modal_projector.",
                  "model.multi_modal_projector.": "multi_modal_projector."}


@dataclass(frozen=True)
class VisionSpec:
    """What the frontend and the gpu worker need to know of a VL checkpoint."""

    architecture: str
    image_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool = False  # Qwen3-VL: the axes' frequencies interleave (t h w t ...)
    # Qwen3-VL's DeepStack: the tower's intermediate features added to the residual stream of
    # the first `deepstack` decoder layers at the image's tokens (0: none).
    deepstack: int = 0
    # Gemma 3: an image's tokens attend to each other both ways during prefill (so no chunk
    # or prefix hit may end inside an image), and every image takes this many tokens.
    bidirectional: bool = False
    tokens_per_image: int = 0


def split_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], VisionSpec | None]:
    """(the language model's config, as its text family spells it; the vision spec, None for
    a text-only checkpoint). ValueError for a VL checkpoint this build cannot serve. Qwen3.5's
    config keeps its nesting, M-RoPE's keys taken out: the hybrid family flattens it."""
    archs = cfg.get("architectures") or []
    vl = next((a for a in archs if a in VL_ARCHITECTURES), None)
    if vl is None:
        vl = _MODEL_TYPES.get(str(cfg.get("model_type")))
    if vl is None:
        return cfg, None
    if vl in _QWEN3_5:
        return _qwen3_5(cfg, vl)
    text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text.update(cfg.get("text_config") or {})
    text["architectures"] = [VL_ARCHITECTURES[vl]]
    text.pop("model_type", None)
    if vl == QWEN3_VL_MOE:
        _vl_moe_text(text)
    if vl == GEMMA3_VL:
        return _gemma3(cfg, text)
    section, interleaved = _mrope(text)
    vision = cfg.get("vision_config") or {}
    image_token = cfg.get("image_token_id", text.get("image_token_id"))
    if image_token is None:
        raise ValueError(f"{vl} config.json has no image_token_id")
    deepstack = len(vision.get("deepstack_visual_indexes") or ()) \
        if vl in (QWEN3_VL, QWEN3_VL_MOE) else 0
    return text, VisionSpec(vl, int(image_token), int(vision.get("spatial_merge_size", 2)),
                            section, interleaved, deepstack)


def _vl_moe_text(text: dict[str, Any]) -> None:
    """Qwen3-VL-MoE's language model as Qwen3-MoE's keys: its own class defaults where the
    config is silent, and the router's top-k weights always renormalised (transformers'
    `Qwen3VLMoeTextTopKRouter` has no `norm_topk_prob` switch)."""
    for key, value in _VL_MOE_DEFAULTS.items():
        text.setdefault(key, value)
    if not (text.get("num_experts") or text.get("num_local_experts")):
        text["num_experts"] = _VL_MOE_EXPERTS
    text["norm_topk_prob"] = True


# Gemma3TextConfig's defaults for the keys a published Gemma 3 VL text_config leaves out
# (google/gemma-3-4b-it names only its sizes and rope scaling); the text family reads the
# rest with defaults of its own. A test keeps these equal to transformers'.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
}


def _gemma3(cfg: dict[str, Any], text: dict[str, Any]) -> tuple[dict[str, Any], VisionSpec]:
    """Gemma 3's language model (published text_configs rely on the class defaults) and
    its spec: SigLIP's patches pooled to `mm_tokens_per_image` tokens per image, plain 1D
    positions, bidirectional attention among an image's tokens."""
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        text.setdefault(key, value)
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if image_token is None:
        raise ValueError(f"{GEMMA3_VL} config.json has no image_token_index")
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    side = int(tokens ** 0.5)
    if side * side != tokens:
        raise ValueError(f"mm_tokens_per_image {tokens} is not a square (the projector pools "
                         "the patch grid to side x side tokens)")
    return text, VisionSpec(GEMMA3_VL, int(image_token), 1, (), bidirectional=True,
                            tokens_per_image=tokens)


def _qwen3_5(cfg: dict[str, Any], vl: str) -> tuple[dict[str, Any], VisionSpec]:
    """The config, nested as it came, less M-RoPE's keys in the text config's rope dict;
    the spec."""
    text = dict(cfg.get("text_config") or {})
    section = _QWEN3_5_SECTION
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5's spelling, the older one
        if isinstance(text.get(key), dict):
            rope = dict(text[key])
            section = tuple(int(x) for x in rope.pop("mrope_section", section))
            rope.pop("mrope_interleaved", None)  # transformers interleaves whatever it says
            text[key] = rope
    image_token = cfg.get("image_token_id", _QWEN3_5_IMAGE_TOKEN)  # the config class default
    vision = cfg.get("vision_config") or {}
    return ({**cfg, "text_config": text},
            VisionSpec(vl, int(image_token), int(vision.get("spatial_merge_size", 2)),
                       section, mrope_interleaved=True))


def _mrope(text: dict[str, Any]) -> tuple[tuple[int, ...], bool]:
    """Pops M-RoPE's section sizes (and whether they interleave) out of the rope dict
    (published: `rope_scaling` of type "mrope", which transformers reads as the default RoPE
    over three position axes)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope = dict(rope)
            section = tuple(int(x) for x in rope.pop("mrope_section"))
            interleaved = bool(rope.pop("mrope_interleaved", False))
            if rope.get("type") == "mrope":
                rope["type"] = "default"
            if rope.get("rope_type") == "mrope":
                rope["rope_type"] = "default"
            text[key] = rope
            return section, interleaved
    raise ValueError("a Qwen VL config.json needs rope mrope_section (rope_parameters or "
                     "rope_scaling)")


def read_spec(model_dir: str) -> VisionSpec | None:
    """The vision spec of a model folder's config.json (None: a text-only model)."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return split_config(json.load(f))[1]


# Images per prompt without --limit-mm-per-prompt.
DEFAULT_IMAGE_LIMIT = 8


def image_limit(text: str) -> int:
    """`--limit-mm-per-prompt` (vLLM's spelling, a JSON object such as '{"image": 4}') ->
    the images a prompt may hold; ValueError naming the flag for anything else."""
    if not text:
        return DEFAULT_IMAGE_LIMIT
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt {text!r} is not JSON (e.g. "
                         "'{\"image\": 4}')") from None
    if not isinstance(value, dict):
        raise ValueError("--limit-mm-per-prompt must be a JSON object such as {\"image\": 4}")
    other = sorted(set(value) - {"image"})
    if other:
        raise ValueError(f"--limit-mm-per-prompt: {', '.join(other)} input is not supported "
                         "(images only)")
    limit = value.get("image", DEFAULT_IMAGE_LIMIT)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"--limit-mm-per-prompt: image must be an integer >= 0, got {limit!r}")
    return limit
