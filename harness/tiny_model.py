"""`tandem make-tiny-model DIR`: the embedded default model.

A tiny Llama checkpoint in Hugging Face layout, deterministic from a fixed seed and built
without any network access.  Its tokenizer is a real one: the Llama-2-style SentencePiece
model (32000 tokens, byte fallback) that the Apache-2.0 `mistral-common` wheel ships.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from tandem_serve.ipc.process import CLI

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048


PRESETS = {
    "default": Preset(256, 688, 4, 4, 2),
    # Short enough a forward step on CPU that postprocessing time matters next to it.
    "fast": Preset(64, 172, 2, 2, 1),
}

# Llama-2's chat format for the Llama-2 tokenizer, so the OpenAI chat endpoint has a template
# to render (transformers 5 reads it from chat_template.jinja next to the tokenizer).
CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is not none %}
            {{- bos_token + '[INST] <<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n'
                + message['content'] | trim + ' [/INST]' }}
        {%- else %}
            {{- bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + ' ' + eos_token }}
    {%- else %}
        {{- raise_exception('Only system, user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""
CHAT_TEMPLATE_FILE = "chat_template.jinja"

SEED = 1234
# HF's default init (std 0.02) gives a tiny model whose greedy output repeats one token;
# larger weights make every next token depend on the context, which keeps parity tests sharp.
INIT_STD = 0.35


def _sentencepiece_model() -> Path:
    path = resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    if not path.is_file():
        raise FileNotFoundError("mistral-common does not ship data/tokenizer.model.v1")
    return Path(str(path))


def _licence_text() -> str:
    dist = metadata.distribution("mistral-common")
    for f in dist.files or []:
        if f.name.upper().startswith("LICENSE"):
            return Path(str(dist.locate_file(f))).read_text()
    return "Apache License 2.0 (text not found in the installed wheel)"


def write_tokenizer(out: Path) -> None:
    """Convert the SentencePiece model into tokenizer.json + tokenizer_config.json."""
    from transformers import LlamaTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(_sentencepiece_model(), Path(tmp) / "tokenizer.model")
        # Not vocab_file=: transformers 5.24 then silently builds a 3-token tokenizer.
        tok = LlamaTokenizerFast.from_pretrained(tmp, legacy=False, add_bos_token=True)
        if len(tok) != 32000:
            raise RuntimeError(f"converted tokenizer has {len(tok)} tokens, expected 32000")
        tok.save_pretrained(str(out))
    shutil.copy(_sentencepiece_model(), out / "tokenizer.model")
    (out / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    (out / "TOKENIZER_LICENSE").write_text(
        "The tokenizer files in this folder are derived from tokenizer.model.v1 shipped in\n"
        "the mistral-common Python package (Mistral AI), licensed under the Apache License,\n"
        "Version 2.0, reproduced below.\n\n" + _licence_text())


def build_tiny_model(out_dir: str, preset: str = "default", seed: int = SEED) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("building tiny model (%s preset) in %s", preset, out)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32")  # type: ignore[call-arg]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD if param.dim() == 2 and "embed" not in name else 1.0)
        # Keep the residual stream in range: scale output projections by depth.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5 / p.num_hidden_layers ** 0.5)
            layer.mlp.down_proj.weight.mul_(0.5 / p.num_hidden_layers ** 0.5)
    log.info("  weights initialised (%.1fM parameters)", model.num_parameters() / 1e6)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(str(out))
    log.info("  converting the SentencePiece tokenizer")
    write_tokenizer(out)
    (out / "tandem_preset.json").write_text(json.dumps({"preset": preset, "seed": seed}))
    log.info("  done: %s", out)
    return out


def default_model_dir(preset: str = "default") -> Path:
    base = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")
    return Path(base) / f"tiny-llama-{preset}"


def ensure_default_model(preset: str = "default", *, in_subprocess: bool = False) -> Path:
    """The cached tiny model, built first if missing.

    `in_subprocess`: build it in a child process, so that torch and transformers (~300 MB of
    resident memory) never load into the caller; the frontend uses this.
    """
    path = default_model_dir(preset)
    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        if not (path / CHAT_TEMPLATE_FILE).exists():  # built before it had one
            tmp = path / f"{CHAT_TEMPLATE_FILE}.tmp{os.getpid()}"
            tmp.write_text(CHAT_TEMPLATE)
            os.replace(tmp, path / CHAT_TEMPLATE_FILE)
        return path
    if in_subprocess:
        subprocess.run([*CLI, "make-tiny-model", "--preset", preset],
                       check=True, stdout=subprocess.DEVNULL)
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(str(tmp), preset)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # atomic: a concurrent start never sees half a model
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", nargs="?", help="output folder (default: the cache folder)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when DIR already holds a model (container first start)")


def main(args: argparse.Namespace) -> int:
    if args.dir and args.if_missing and (Path(args.dir) / "config.json").exists():
        log.info("%s already holds a model", args.dir)
    elif args.dir:
        build_tiny_model(args.dir, args.preset, args.seed)
    else:
        print(ensure_default_model(args.preset))
    return 0
