"""Tiny random vision-language checkpoints written by transformers itself, with the
checkpoint's own processor files (preprocessor_config.json, tokenizer, chat template).

    path = vl_checkpoint(root, "qwen2_5_vl")

The vision tower is two blocks (one windowed, one full attention for Qwen2.5-VL) over 14-pixel
patches merged 2x2; the image processor's `max_pixels` is small so an image is a handful of
placeholder tokens. The tokenizer is the tests' tiny byte-level BPE plus the family's
special tokens; the chat template is the published one, images only.
"""
from __future__ import annotations

import io
import math
import os
import tempfile
from typing import Any

import numpy as np
import torch

from tests.gpu_worker.model_utils import save_tiny_tokenizer

QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
TEXT_VOCAB = 500  # the BPE's own tokens; the special tokens follow
VOCAB = 512

QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


GEMMA_SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                 "<image_soft_token>"]
# Gemma 3's published chat template, images and text only (no system turn folding).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image_url' in item %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA_IMAGE = 64  # pixels a side: 8x8 SigLIP patches of 8, pooled 2x2 to 16 tokens


def _randomize(model: torch.nn.Module, seed: int, gemma: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Gemma scales embeddings by sqrt(hidden): kept at the scale of what the layers add, or
    # the tied head predicts the input token again (as tests/gpu_worker/family_utils.py).
    embed_std = 64 ** -0.5 if gemma else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name
                                                                     else 0.0))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * embed_std)
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / math.sqrt(fan_in))


def _tokenizer(path: str, special: list[str] = QWEN_SPECIAL, template: str = QWEN_TEMPLATE
               ) -> Any:
    from transformers import AutoTokenizer

    save_tiny_tokenizer(path, TEXT_VOCAB)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.chat_template = template
    return tok


def gemma3_checkpoint(root: str | os.PathLike[str], seed: int = 0, published: bool = False
                      ) -> str:
    """A tiny Gemma 3 VL folder as transformers writes it (`language_model.model.*`,
    `vision_tower.*`), or with the published tensor names (`published`: SigLIP under
    `vision_tower.vision_model.*`), with Gemma3Processor's files: one sliding layer of a
    window shorter than an image, one global layer."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    path = tempfile.mkdtemp(prefix="tiny-gemma3-", dir=os.fspath(root))
    tok = _tokenizer(path, GEMMA_SPECIAL, GEMMA_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=1,
                eos_token_id=2, pad_token_id=0, query_pre_attn_scalar=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=GEMMA_IMAGE, patch_size=8)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=16,
        image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    _randomize(model, seed, gemma=True)
    model.eval().save_pretrained(path)
    if published:  # SigLIP's `vision_model.` level; a text_config of few keys
        weights = os.path.join(path, "model.safetensors")
        tensors = load_file(weights)
        save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
                   for k, v in tensors.items()}, weights, metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        text_cfg = cfg["text_config"]
        for key in ("layer_types", "_sliding_window_pattern", "rms_norm_eps",
                    "hidden_activation", "use_bidirectional_attention"):
            text_cfg.pop(key, None)
        text_cfg["sliding_window_pattern"] = 2
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    tok.save_pretrained(path)
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        tok_config = json.load(f)
    tok_config.update(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                      image_token="<image_soft_token>")
    with open(config_file, "w") as f:
        json.dump(tok_config, f)
    image = transformers.Gemma3ImageProcessor(size={"height": GEMMA_IMAGE,
                                                    "width": GEMMA_IMAGE})
    processor = transformers.Gemma3Processor(
        image, transformers.AutoTokenizer.from_pretrained(path), image_seq_length=16)
    processor.save_pretrained(path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(GEMMA_TEMPLATE)
    return path


def vl_checkpoint(root: str | os.PathLike[str], family: str = "qwen2_5_vl",
                  seed: int = 0) -> str:
    """Build, randomise and save a tiny VL checkpoint (float32) with its processor; its
    folder."""
    import transformers

    path = tempfile.mkdtemp(prefix=f"tiny-{family}-", dir=os.fspath(root))
    tok = _tokenizer(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                  out_hidden_size=64, spatial_merge_size=2,
                                  temporal_patch_size=2)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [2, 3, 3]}
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
        config: Any = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                    **tokens)
        model: Any = transformers.Qwen2_5_VLForConditionalGeneration
        patch = 14
    elif family in ("qwen3_5", "qwen3_5_moe"):
        config, model = _qwen3_5_config(text, vision, tokens, family == "qwen3_5_moe")
        patch = 16
    else:
        assert family in ("qwen3_vl", "qwen3_vl_moe"), family
        # Qwen3: q/k norms, a head_dim of its own; interleaved M-RoPE; DeepStack from both
        # tower blocks into the first two decoder layers (of three).
        text.update(num_hidden_layers=3, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
            "mrope_interleaved": True})
        vision.update(patch_size=16, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
        config_class, model = (transformers.Qwen3VLConfig,
                               transformers.Qwen3VLForConditionalGeneration)
        if family == "qwen3_vl_moe":
            # 8 experts top-2 of width 48 (2I != H and I != H: the stacked tensors' layout
            # shows in their shapes), a dense middle layer (`mlp_only_layers`).
            text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                        mlp_only_layers=[1])
            config_class, model = (transformers.Qwen3VLMoeConfig,
                                   transformers.Qwen3VLMoeForConditionalGeneration)
        config = config_class(text_config=text, vision_config=vision, **tokens)
        patch = 16
    torch.manual_seed(seed)
    model = model(config)
    _randomize(model, seed)
    if family.startswith("qwen3_5"):  # the linear layers' slow decays, as the hybrid tests
        _slow_decays(model, seed)
    model.eval().save_pretrained(path)
    if family.startswith("qwen3_5"):
        _add_mtp_head(path)
    unit = patch * 2
    image = transformers.Qwen2VLImageProcessor(
        min_pixels=unit * unit * 4, max_pixels=unit * unit * 64, patch_size=patch,
        merge_size=2)
    image.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(QWEN_TEMPLATE)
    return path


def _qwen3_5_config(text: dict[str, Any], vision: dict[str, Any], tokens: dict[str, Any],
                    moe: bool) -> tuple[Any, Any]:
    """Qwen3.5: three Gated DeltaNet layers then a gated attention layer, RoPE on half of
    each head, interleaved M-RoPE spelled as published (`mrope_section` over the rotary
    frequencies), a tower without DeepStack; MoE: 4 experts top-2 and a shared expert."""
    import transformers

    text = {**text, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                "mrope_interleaved": True}}
    vision = {**vision, "patch_size": 16, "num_position_embeddings": 64}
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
        return (transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                              **tokens),
                transformers.Qwen3_5MoeForConditionalGeneration)
    return (transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens),
            transformers.Qwen3_5ForConditionalGeneration)


@torch.no_grad()
def _slow_decays(model: torch.nn.Module, seed: int) -> None:
    """The hybrid tests' slow decays: the state remembers the image far back, so a state or
    position gone wrong changes tokens."""
    from tests.gpu_worker.hybrid_utils import slow_decay_logs

    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(slow_decay_logs(p.shape, gen))


def _add_mtp_head(path: str) -> None:
    """The published Qwen3.5 folders carry a multi-token-prediction head (`mtp.*`), which the
    server leaves out."""
    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, weights, metadata={"format": "pt"})


def published_vl_moe(path: str, root: str | os.PathLike[str]) -> str:
    """A copy of a Qwen3-VL-MoE folder written by transformers 5 as the published
    checkpoints spell it: stacked experts in the matmul layout (gate|up [E, H, 2I], down
    [E, I, H]) and the text config's `num_experts` and `rope_scaling` + `rope_theta`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tempfile.mkdtemp(prefix="published-", dir=os.fspath(root))
    shutil.copytree(path, out, dirs_exist_ok=True)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t.transpose(1, 2).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    text = cfg["text_config"]
    text["num_experts"] = text.pop("num_local_experts")
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = {**rope, "rope_type": "default"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def png_bytes(seed: int, size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    """A random RGB image, encoded."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


class VLReference:
    """transformers' model, tokenizer, chat template and image processor of a VL folder: the
    processor's expansion done as `Qwen2_5_VLProcessor` does it (the text's placeholder
    repeated once per merged patch, then tokenized), since the processor class itself wants
    a video processor (torchvision) that an images-only test does not need."""

    def __init__(self, path: str) -> None:
        import transformers

        self.path = path
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32).eval()
        # Gemma 3's processor needs no video processor: it is used as it is.
        self.gemma = self.model.config.model_type == "gemma3"
        self.processor = transformers.AutoProcessor.from_pretrained(path) if self.gemma \
            else None
        self.image_token = "<image_soft_token>" if self.gemma else "<|image_pad|>"
        self.image_token_id = self.tok.convert_tokens_to_ids(self.image_token)

    def inputs(self, messages: list[dict[str, Any]], images: list[bytes]) -> dict[str, Any]:
        from PIL import Image

        with open(os.path.join(self.path, "chat_template.jinja")) as f:
            template = f.read()
        text = self.tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                            add_generation_prompt=True)
        if self.processor is not None:  # the template writes BOS
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
            return dict(self.processor(text=text, images=pil, return_tensors="pt",
                                       add_special_tokens=False))
        out: dict[str, Any] = {}
        if images:
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            out = dict(self.images(images=pil, return_tensors="pt"))
            merge = self.images.merge_size ** 2
            for grid in out["image_grid_thw"]:
                n = int(grid.prod()) // merge
                text = text.replace(self.image_token, "<|placeholder|>" * n, 1)
            text = text.replace("<|placeholder|>", self.image_token)
        ids = self.tok(text, return_tensors="pt", add_special_tokens=False)
        out.update(ids)
        out["mm_token_type_ids"] = (ids["input_ids"] == self.image_token_id).int()
        return out

    @torch.no_grad()
    def greedy(self, messages: list[dict[str, Any]], images: list[bytes], n: int
               ) -> tuple[list[int], int]:
        """(greedy continuation, prompt length), stopping at EOS."""
        inp = self.inputs(messages, images)
        out = self.model.generate(**inp, max_new_tokens=n, do_sample=False,
                                  eos_token_id=self.tok.eos_token_id,
                                  pad_token_id=self.tok.pad_token_id)
        length = int(inp["input_ids"].shape[1])
        return out[0, length:].tolist(), length


def image_message(text: str, count: int = 1) -> list[dict[str, Any]]:
    """One user message of `count` images then `text`, as HF's templates read it."""
    return [{"role": "user", "content": [{"type": "image"}] * count
             + [{"type": "text", "text": text}]}]


def worker_case(ref: VLReference, messages: list[dict[str, Any]], images: list[bytes],
                n: int) -> tuple[list[int], list[Any], list[int]]:
    """(prompt ids, ImageInputs, HF's greedy tokens) of a chat as HF's processor makes it,
    for driving the gpu worker directly."""
    import hashlib

    from tandem_serve.proto.request_params import ImageInput

    inp = ref.inputs(messages, images)
    ids = inp["input_ids"][0].tolist()
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] != ref.image_token_id:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == ref.image_token_id:
            j += 1
        runs.append((i, j - i))
        i = j
    out: list[ImageInput] = []
    if images and ref.gemma:  # one [1, 3, H, W] image per run of its tokens
        pixels = inp["pixel_values"].numpy()
        for i, (offset, length) in enumerate(runs):
            part = pixels[i:i + 1]
            side = int(length ** 0.5)
            digest = hashlib.blake2b(part.tobytes(), digest_size=16).digest()
            out.append(ImageInput(offset, length, digest, part, [1, side, side],
                                  bidirectional=True))
    elif images:
        pixels, at = inp["pixel_values"].numpy(), 0
        for (offset, length), grid in zip(runs, inp["image_grid_thw"].numpy(), strict=True):
            part = pixels[at:at + int(grid.prod())]
            at += int(grid.prod())
            digest = hashlib.blake2b(part.tobytes(), digest_size=16).digest()
            out.append(ImageInput(offset, length, digest, part, [int(x) for x in grid]))
    return ids, out, ref.greedy(messages, images, n)[0]


def vl_adapter(ref: VLReference, out_dir: str, seed: int = 7) -> Any:
    """A PEFT LoRA adapter on the language model's attention of `ref`'s model (PEFT names its
    tensors `model.language_model.layers...`), lora_B randomised; and the PeftModel."""
    from peft import LoraConfig, get_peft_model

    # The language model's layers only (Gemma 3's SigLIP layers have q/k/v projections too).
    # Qwen3.5's MLPs too: one layer in four has attention.
    modules = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)" \
        if ref.model.config.model_type == "qwen3_5" else r"self_attn\.(q|k|v|o)_proj"
    config = LoraConfig(r=4, lora_alpha=8,
                        target_modules=r".*language_model\.(model\.)?layers\.\d+\." + modules)
    model = get_peft_model(ref.model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
            elif "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return model.eval()
