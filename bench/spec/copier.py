"""The copier: the tiny default checkpoint turned into a model whose greedy output copies.

The tiny default model is random, so it does not follow "repeat this passage"; a benchmark
of prompt lookup on it would measure prompts the model never copies.  The copier is the same
checkpoint (same shapes, same forward cost) with two changes:

* every layer's attention output projection and MLP down projection are zero, so each layer
  adds nothing to the residual stream: the next token depends on the current token only (an
  exact bigram model, computed by the full forward).  The tests' copier
  (tests/gpu_worker/model_utils.py) scales them by 0.05 instead; on this checkpoint's much
  larger weights that still leaves the output context-driven, and any scale in between
  would be a knob tuned for a result, so the bench takes the exact end;
* the output head keeps only whole-word pieces ("▁" + 3 or more lowercase letters that the
  tokenizer encodes alone as that piece): its greedy text is words joined by spaces, which
  re-encodes to the same ids, as text-only clients need (the other rows are zero, so their
  logit 0 never beats the best word's).

Its greedy chain from a token is therefore t, f(t), f(f(t)), ... with f computed here in
closed form from the weights; a prompt holding a stretch of that chain, then the stretch's
start again, is continued by copying the stretch.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

# Bumped when the recipe changes, so a cached copier of an older recipe is rebuilt.
RECIPE = 1
MARKER = "tandem_copier.json"
_WORD = re.compile(r"▁[a-z]{3,}")
_ZEROED = ("o_proj", "down_proj")


def word_ids(tokenizer: Any) -> list[int]:
    """Ids of pieces that are one lowercase word after a space and encode alone to
    themselves: any sequence of them decodes to text that encodes back to it."""
    out = []
    for i in range(len(tokenizer)):
        piece = tokenizer.id_to_token(i)
        if piece and _WORD.fullmatch(piece) and \
                tokenizer.encode(piece[1:], add_special_tokens=False) == [i]:
            out.append(i)
    if not out:
        raise ValueError("the tokenizer has no whole-word pieces for the copier")
    return out


def copier_dir() -> Path:
    from tandem_serve.harness.tiny_model import default_model_dir

    return default_model_dir("copier")


def ensure_copier() -> Path:
    """The cached copier, built from the cached tiny default model when missing."""
    path = copier_dir()
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == RECIPE:
        return path
    from tandem_serve.harness.tiny_model import ensure_default_model

    source = ensure_default_model(in_subprocess=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    build_copier(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # atomic: a concurrent bench never sees half a model
    return path


def build_copier(folder: Path) -> None:
    """Rewrite the checkpoint in `folder` (a copy of a tiny model) into the copier."""
    import torch
    from safetensors.torch import load_file, save_file

    from tandem_serve.tokenization.tokenizer import Tokenizer

    words = word_ids(Tokenizer.from_dir(str(folder)))
    file = folder / "model.safetensors"
    weights = load_file(str(file))
    for name in weights:
        if any(part in name for part in _ZEROED):
            weights[name] = torch.zeros_like(weights[name])
    head = weights["lm_head.weight"]
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[words] = True
    weights["lm_head.weight"] = torch.where(keep.unsqueeze(1), head, torch.zeros_like(head))
    save_file(weights, str(file), metadata={"format": "pt"})
    (folder / MARKER).write_text(json.dumps({"recipe": RECIPE, "words": len(words)}))


class NextToken:
    """f: a token id -> the copier's greedy next token after it (in any context), computed
    from the weights on demand (a chain visits few of the words)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors.torch import load_file

        config = json.loads((Path(folder) / "config.json").read_text())
        weights = load_file(str(Path(folder) / "model.safetensors"))
        self.head = weights["lm_head.weight"].float()
        self.embed = weights["model.embed_tokens.weight"].float()
        self.norm = weights["model.norm.weight"].float()
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.words = sorted((self.head.abs().sum(dim=1) > 0).nonzero().squeeze(1).tolist())
        self._cache: dict[int, int] = {}

    def __call__(self, token: int) -> int:
        import torch

        if token not in self._cache:
            h = self.embed[token]
            h = h * torch.rsqrt(h.pow(2).mean() + self.eps) * self.norm
            self._cache[token] = int((self.head @ h).argmax())
        return self._cache[token]


def chain(f: NextToken, start: int, length: int) -> list[int]:
    """The copier's greedy chain of `length` tokens from `start`."""
    out = [start]
    while len(out) < length:
        out.append(f(out[-1]))
    return out


def ensure_copier_draft() -> Path:
    """The copier's first layer alone, for the `draft_model` method: the same embedding,
    norm and head, so the same next-token map at a quarter of the layers."""
    target = ensure_copier()
    path = target.with_name(target.name + "-draft")
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == RECIPE:
        return path
    from safetensors.torch import load_file, save_file

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    file = tmp / "model.safetensors"
    weights = {k: v for k, v in load_file(str(file)).items()
               if not re.match(r"model\.layers\.([1-9]|\d\d+)\.", k)}
    save_file(weights, str(file), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
