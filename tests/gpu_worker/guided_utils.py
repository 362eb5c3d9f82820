"""Guided-decoding helpers for the runner tests: tables from outlines-core, and the HF
reference (greedy `generate()` with a LogitsProcessor that masks with an outlines-core Guide).

The checkpoint is the tiny llama of `runner_driver.CONFIGS["llama-gqa"]` with its byte-level
BPE tokenizer (512 tokens, EOS 2), so constraints are regexes over real text.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from tandem_serve.harness.guided_tables import regex_table, vocabulary
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import GuidedKind, SamplingParams
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.gpu_worker.model_utils import EOS_ID, make_tiny_checkpoint

VOCAB = 512
_paths: dict[str, str] = {}
_models: dict[str, Any] = {}
_refs: dict[tuple[str, str, tuple[int, ...], int, int, str], list[int]] = {}
_indexes: dict[tuple[str, str], Any] = {}


def guided_checkpoint(root: Path) -> str:
    """The tiny llama with its tokenizer (built once per test run)."""
    if "llama" not in _paths:
        _paths["llama"] = make_tiny_checkpoint(root, "llama", seed=5)
    return _paths["llama"]


def table(path: str, regex: str) -> GuidedTable:
    return regex_table(regex, Tokenizer.from_dir(path), VOCAB)


def grammar(lark: str) -> GuidedGrammar:
    return GuidedGrammar("grammar-" + hashlib.sha256(lark.encode()).hexdigest()[:16], lark)


def guided(constraint: GuidedTable | GuidedGrammar, max_new: int = 24,
           **kw: Any) -> SamplingParams:
    if isinstance(constraint, GuidedTable):
        kind, gid = GuidedKind.TABLE, constraint.table_id
    else:
        kind, gid = GuidedKind.GRAMMAR, constraint.grammar_id
    kw.setdefault("stop_token_ids", [EOS_ID])
    return SamplingParams(max_new_tokens=max_new, guided_kind=kind, guided_id=gid, **kw)


def text(path: str, out: list[int]) -> str:
    """The constrained text: the output without its final EOS."""
    ids = out[:-1] if out and out[-1] == EOS_ID else out
    return Tokenizer.from_dir(path).decode(ids)


class GuideMask:
    """An HF LogitsProcessor: -inf on what an outlines-core Guide forbids after the tokens
    generated so far.  With `min_new`, EOS is also forbidden before `min_new` tokens, but only
    where the guide allows something else (the engine's rule for min_new_tokens)."""

    def __init__(self, index: Any, prompt_len: int, min_new: int = 0) -> None:
        from outlines_core import Guide

        self.guide = Guide(index)
        self.prompt_len = prompt_len
        self.min_new = min_new
        self.consumed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len:].tolist()
        for tok in out[self.consumed:]:
            self.guide.advance(tok, return_tokens=False)
        self.consumed = len(out)
        allowed = list(self.guide.get_tokens())
        others = [t for t in allowed if t != EOS_ID]
        if len(out) < self.min_new and others:
            allowed = others
        mask = torch.full_like(scores, float("-inf"))
        mask[:, allowed] = 0.0
        return scores + mask


def _model(path: str, adapter: str | None = None) -> Any:
    """The float32 HF model (through PEFT's PeftModel when an adapter folder is given)."""
    key = f"{path}\0{adapter or ''}"
    if key not in _models:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).eval()
        _models[key] = model
    return _models[key]


def hf_guided(path: str, regex: str, prompt: list[int], n: int, min_new: int = 0,
              adapter: str | None = None) -> list[int]:
    """HF greedy generate() under the regex (float32, stops at EOS); with `adapter` (a PEFT
    LoRA folder) through PeftModel, the judge of guided rows under an adapter."""
    from outlines_core import Index
    from transformers import LogitsProcessorList

    key = (path, regex, tuple(prompt), n, min_new, adapter or "")
    if key not in _refs:
        if (path, regex) not in _indexes:  # 0.5 s over a 32k vocabulary: built once
            _indexes[path, regex] = Index(regex, vocabulary(Tokenizer.from_dir(path)))
        index = _indexes[path, regex]
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            out = _model(path, adapter).generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=n,
                logits_processor=LogitsProcessorList([GuideMask(index, len(prompt), min_new)]))
        _refs[key] = out[0, len(prompt):].tolist()
    return _refs[key]


def hf_logprobs(path: str, prompt: list[int], out: list[int]) -> list[float]:
    """The model's own (unconstrained) logprob of each output token, from one HF forward."""
    ids = torch.tensor([prompt + out], dtype=torch.int64)
    with torch.no_grad():
        logits = _model(path)(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
    return lp.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1).tolist()
