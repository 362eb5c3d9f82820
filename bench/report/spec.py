"""The speculative decoding section of `tandem bench report`: `tandem bench spec`'s fast
preset, with what its model and workloads are."""
from __future__ import annotations

from tandem_serve.bench.report.commands import Context, command_section

INTRO = (
    "Speculative decoding (`--speculative-config`, ngram prompt lookup: k=4 draft tokens, "
    "n-grams of 4 down to 2) against no speculation, for async K=8 and sync K=1. One server "
    "per arm, all up together; every cell (workload × batch) runs the same requests on each "
    "arm back to back, in an order that alternates between cells. The model is the *copier* "
    "(`bench/spec/copier.py`): the tiny default checkpoint with every layer's attention "
    "output and MLP down projections zeroed, so the next token depends on the current one "
    "only (an exact bigram model that still pays the whole forward), and its output head "
    "kept to whole-word pieces only, so its text re-encodes to the same ids. *copy*: the "
    "copier's own greedy chain of 128 tokens from a random word, then the chain's first 8 "
    "tokens again; greedy, the model continues by copying the passage, so the prompt holds "
    "every output token and the drafts' acceptance is the ceiling prompt lookup can reach "
    "(not a tuned figure). *plain*: `bench serve`'s random 128-token prompts, nothing to "
    "copy (drafts appear only where the copier's own output enters a cycle). 32 greedy "
    "tokens per request, batch = concurrency, max(4, batch) requests per run. Acceptance = "
    "accepted / draft tokens (counter deltas over the run). Tokens / verify row = output "
    "tokens / (output tokens − accepted drafts): every output token comes from a row of some "
    "forward (a decode step's verify row, or the prompt's last position, which verifies "
    "drafts too when the prompt offers some), and a row emits 1 + its accepted drafts. "
    "Ratios: to no speculation in the same cell, median over repeats. On a CPU each of a "
    "verify row's 1+k positions costs what a plain row does (docs/DESIGN.md §16), so the "
    "gain here is the forwards saved at small batches; `scripts/gpu-check` runs the same "
    "preset on a GPU.")


def spec(ctx: Context) -> str:
    return command_section(ctx, INTRO, ["bench", "spec", "--preset", "fast", "--repeats",
                                        str(ctx.repeats)])
