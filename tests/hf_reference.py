"""The judge of every end-to-end parity test: HF `generate()` greedy text, one prompt at a time."""
from __future__ import annotations

import pathlib
from collections.abc import Sequence


def hf_greedy(model_dir: str | pathlib.Path, jobs: Sequence[tuple[str, int]],
              adapter: str | pathlib.Path | None = None) -> list[str]:
    """Exactly n new tokens per (text, n) (EOS suppressed like min_new_tokens = n), decoded;
    through `peft.PeftModel.from_pretrained(model, adapter)` when an adapter folder is given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    out = []
    for text, n in jobs:
        ids = tok(text, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out
