"""Image input without a server: VL configs as published and as transformers 5 writes them,
the refusals (architectures not served yet, a text-only model, --limit-mm-per-prompt),
speculation accepted on a VL model, image decoding limits, placeholder expansion, and
prefix-cache hashes keyed by image content."""
from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import numpy as np
import pytest

from tandem_serve.frontend.media.fetch import MediaPolicy, decode_image
from tandem_serve.frontend.media.images import ImagePreprocessor, ImageRef, Images, Processed
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.proto.request_params import ImageInput
from tandem_serve.proto.vision import DEFAULT_IMAGE_LIMIT, VisionSpec, image_limit, split_config
from tandem_serve.scheduler.kv.block_manager import prompt_block_hashes

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=1024, eos_token_id=2)


def _configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformers 5's nested config, the published top-level spelling) of one model."""
    nested = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "image_token_id": 504, "vision_config": {"spatial_merge_size": 2},
              "text_config": {**TEXT, "rope_parameters": {
                  "rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}}
    published = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], **TEXT,
                 "model_type": "qwen2_5_vl", "image_token_id": 504, "rope_theta": 1e6,
                 "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                 "vision_config": {"spatial_merge_size": 2}}
    return nested, published


def test_published_and_transformers_configs_read_to_the_same_model() -> None:
    nested, published = _configs()
    a, b = (ModelArgs.from_hf_config(json.loads(json.dumps(c))) for c in (nested, published))
    assert a == b
    assert a.architecture == "Qwen2ForCausalLM" and a.qkv_bias
    assert a.mrope_section == (2, 3, 3) and a.image_token_id == 504 and a.rope_theta == 1e6
    bad = {**published, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}
    with pytest.raises(ValueError, match="must sum to the rotary dimension / 2 = 8"):
        ModelArgs.from_hf_config(bad)


def test_qwen3_vl_moe_reads_as_qwen3_moe_with_its_own_defaults() -> None:
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
            "mrope_interleaved": True}
    cfg = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": 504,
           "vision_config": {"spatial_merge_size": 2, "deepstack_visual_indexes": [0, 1]},
           "text_config": {**TEXT, "rope_parameters": rope}}
    a = ModelArgs.from_hf_config(json.loads(json.dumps(cfg)))
    # Keys left out mean Qwen3VLMoeTextConfig's defaults, not Qwen3-MoE's (128 / 8 / 768).
    assert (a.architecture, a.num_experts, a.num_experts_per_tok,
            a.moe_intermediate_size) == ("Qwen3MoeForCausalLM", 60, 4, 1408)
    assert a.norm_topk_prob and a.moe_layers == (True, True) and a.qk_norm
    assert a.deepstack_layers == 2 and a.mrope_interleaved and a.image_token_id == 504
    # The published spelling; its router renormalises whatever norm_topk_prob says.
    cfg["text_config"].update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              decoder_sparse_step=2, norm_topk_prob=False)
    a = ModelArgs.from_hf_config(cfg)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (8, 2, 32)
    assert a.norm_topk_prob and a.moe_layers == (False, True)


@pytest.mark.parametrize("head_dim, section", [(256, [11, 11, 10]), (16, None)],
                         ids=["published", "default-sections-past-the-rotary-dims"])
def test_qwen3_5_reads_as_its_hybrid_model_with_transformers_rotary(
        head_dim: int, section: list[int] | None) -> None:
    """A published Qwen3.5 config (the hybrid text_config, M-RoPE over a quarter of each head)
    reads to the hybrid model with its vision spec; its rotary cos/sin at 3-axis positions
    equal transformers' `Qwen3_5TextRotaryEmbedding`, also where the default sections name
    more frequencies than the rotary dimensions hold."""
    import torch
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from tandem_serve.gpu_worker.models.rope import model_ropes

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25}
    if section is not None:
        rope.update(mrope_section=section, mrope_interleaved=True)
    text = {**TEXT, "num_hidden_layers": 4, "head_dim": head_dim, "model_type": "qwen3_5_text",
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "rope_parameters": rope}
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "image_token_id": 504, "vision_config": {"spatial_merge_size": 2},
           "text_config": text}
    a = ModelArgs.from_hf_config(json.loads(json.dumps(cfg)))
    assert (a.architecture, a.language_model, a.is_hybrid) == ("Qwen3_5ForCausalLM", True, True)
    assert a.mrope_section == (11, 11, 10) and a.mrope_interleaved and a.image_token_id == 504
    assert a.rotary_dim == head_dim // 4
    ours = model_ropes(a)[0][0]
    theirs = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5TextConfig(**text))
    positions = torch.randint(0, 500, (3, 7))
    cos, sin = ours.cos_sin(positions, torch.float32)
    want_cos, want_sin = theirs(torch.zeros(1), positions[:, None, :])
    torch.testing.assert_close(cos[:, 0], want_cos[0])
    torch.testing.assert_close(sin[:, 0], want_sin[0])


def test_text_only_configs_pass_through() -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], **TEXT}
    assert split_config(cfg) == (cfg, None)


def test_limit_mm_per_prompt() -> None:
    assert image_limit("") == DEFAULT_IMAGE_LIMIT
    assert image_limit('{"image": 0}') == 0 and image_limit('{"image": 3}') == 3
    for text, why in [("3", "JSON object"), ("{", "not JSON"), ('{"video": 1}', "video"),
                      ('{"image": -1}', "integer >= 0"), ('{"image": true}', "integer")]:
        with pytest.raises(ValueError, match=why):
            image_limit(text)


def test_a_text_only_model_refuses_images_naming_the_part() -> None:
    images = Images(MediaPolicy(), None)
    ref = ImageRef("data:image/png;base64,AAAA", "messages[1].content[0].image_url")
    with pytest.raises(ValidationError, match="does not take images") as exc:
        asyncio.run(images.prepare([ref]))
    assert exc.value.field == ref.field


def test_decoding_checks_the_format_and_the_pixels_before_decoding() -> None:
    from PIL import Image

    def encoded(size: tuple[int, int], fmt: str) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", size).save(out, format=fmt)
        return out.getvalue()

    policy = MediaPolicy(max_pixels=100 * 100)
    assert decode_image(encoded((100, 100), "PNG"), "f", policy).size == (100, 100)
    assert decode_image(encoded((30, 20), "WEBP"), "f", policy).mode == "RGB"
    with pytest.raises(ValidationError, match="101x100 pixels, more than 10000"):
        decode_image(encoded((101, 100), "PNG"), "f", policy)
    with pytest.raises(ValidationError, match="format BMP is not supported"):
        decode_image(encoded((10, 10), "BMP"), "f", policy)
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    first = decode_image(gif.getvalue(), "f", policy)  # an animated GIF: its first frame
    assert first.mode == "RGB" and first.getpixel((3, 3)) == (255, 0, 0)
    with pytest.raises(ValidationError, match="not an image"):
        decode_image(b"\x89PNG but not really", "f", policy)
    truncated = encoded((100, 100), "PNG")[:60]  # the header, not the pixels
    with pytest.raises(ValidationError, match="does not decode"):
        decode_image(truncated, "f", policy)


def _expander() -> ImagePreprocessor:
    pre = ImagePreprocessor.__new__(ImagePreprocessor)  # expand() reads only the spec
    pre.spec = VisionSpec("Qwen2_5_VLForConditionalGeneration", 9, 2, (2, 3, 3))
    return pre


def _processed(tokens: int, tag: bytes) -> Processed:
    return Processed(np.zeros((4 * tokens, 8), np.float32), [1, 2, 2 * tokens], tokens, tag)


def test_placeholders_expand_to_one_token_per_embedding() -> None:
    pre = _expander()
    ids, images = pre.expand([1, 9, 5, 9, 6], [_processed(3, b"a"), _processed(2, b"b")])
    assert ids == [1, 9, 9, 9, 5, 9, 9, 6]
    assert [(i.offset, i.length, i.digest) for i in images] == [(1, 3, b"a"), (5, 2, b"b")]
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        pre.expand([1, 9, 5, 9, 6], [_processed(3, b"a")])
    with pytest.raises(ValueError, match="ends with an image"):
        pre.expand([1, 9], [_processed(3, b"a")])


def test_block_hashes_follow_the_images_they_hold() -> None:
    def image(offset: int, digest: bytes) -> ImageInput:
        return ImageInput(offset, 10, digest, np.zeros((1, 1), np.float32), [1, 2, 20])

    prompt = np.arange(64, dtype=np.int32)
    plain = prompt_block_hashes(prompt, 16)
    a = prompt_block_hashes(prompt, 16, None, [image(20, b"a" * 16)])
    b = prompt_block_hashes(prompt, 16, None, [image(20, b"b" * 16)])
    assert a[0] == b[0] == plain[0]  # before the image: shared
    assert len({a[1], b[1], plain[1]}) == 3  # the image's block, and all after it, differ
    assert a[3] != b[3]
    assert prompt_block_hashes(prompt, 16, None, [image(20, b"a" * 16)]) == a


def test_speculation_on_a_vl_model_is_accepted(tmp_path: Any) -> None:
    from tandem_serve.proto.config import ServerConfig

    nested, _ = _configs()
    (tmp_path / "config.json").write_text(json.dumps(nested))
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert ServerConfig(model=str(tmp_path), speculative_config=spec).speculative_config == spec
    assert ServerConfig(model=str(tmp_path)).limit_mm_per_prompt == ""


# google/gemma-3-4b-it's config.json: its text_config names only what differs from
# Gemma3TextConfig's defaults.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_gemma3_published_config_reads_with_transformers_defaults() -> None:
    import transformers

    from tandem_serve.proto.vision import GEMMA3_TEXT_DEFAULTS

    hf = transformers.Gemma3TextConfig()
    assert {k: getattr(hf, k) for k in GEMMA3_TEXT_DEFAULTS} == GEMMA3_TEXT_DEFAULTS
    args = ModelArgs.from_hf_config(json.loads(json.dumps(GEMMA3_4B)))
    assert (args.architecture, args.vocab_size, args.num_heads, args.num_kv_heads,
            args.head_dim, args.image_token_id) == ("Gemma3ForCausalLM", 262208, 8, 4, 256,
                                                    262144)
    assert args.sliding_windows[:6] == (1024,) * 5 + (None,) and not args.mrope_section
    assert args.eos_token_ids == (1, 106) and args.tie_word_embeddings
    spec = split_config(GEMMA3_4B)[1]
    assert spec is not None and spec.bidirectional and spec.tokens_per_image == 256
    with pytest.raises(ValueError, match="not a square"):
        split_config({**GEMMA3_4B, "mm_tokens_per_image": 200})


def _gemma_expander() -> ImagePreprocessor:
    pre = ImagePreprocessor.__new__(ImagePreprocessor)
    pre.spec = VisionSpec("Gemma3ForConditionalGeneration", 9, 1, (), bidirectional=True,
                          tokens_per_image=3)
    pre.placeholder, pre.sequence = "<boi>", "\n\n<boi><img><img><img><eoi>\n\n"
    return pre


def test_gemma3_expands_the_text_then_finds_each_image_run() -> None:
    pre = _gemma_expander()
    assert pre.expand_text("a<boi>b<boi>c", 2) == ("a\n\n<boi><img><img><img><eoi>\n\nb"
                                                   "\n\n<boi><img><img><img><eoi>\n\nc")
    with pytest.raises(ValueError, match="1 <boi> for 2 images"):
        pre.expand_text("a<boi>b", 2)
    ids, images = pre.expand([1, 7, 9, 9, 9, 8, 5, 7, 9, 9, 9, 8, 6],
                             [_processed(3, b"a"), _processed(3, b"b")])
    assert ids == [1, 7, 9, 9, 9, 8, 5, 7, 9, 9, 9, 8, 6]
    assert [(i.offset, i.length, i.digest, i.bidirectional) for i in images] == [
        (2, 3, b"a", True), (8, 3, b"b", True)]
    with pytest.raises(ValueError, match=r"runs of \[3, 4\], not 2 of 3"):
        pre.expand([7, 9, 9, 9, 8, 9, 9, 9, 9, 6], [_processed(3, b"a"), _processed(3, b"b")])
    with pytest.raises(ValueError, match="ends with an image"):
        pre.expand([7, 9, 9, 9], [_processed(3, b"a")])
