"""Grammar-constrained rows: llguidance matchers on the worker's host, a bitmask per step.

A context-free grammar has no finite table, so its rows cannot be stepped on the device: a
`LLMatcher` per row consumes each sampled token on the host and computes the next step's
bitmask of allowed tokens.  That needs step k's tokens on the host before step k+1 samples,
the one host read inside the K-step loop, paid only by plans that hold grammar rows:

    step k:  forward(k) launched ─┐                      ┌─ wait mask(k) → mask → sample(k)
    thread:                       └ tokens(k-1) arrive → consume → fill mask(k) ┘

After sampling step k the worker queues the grammar rows' tokens to one helper thread (on
CUDA through pinned memory and a copy event, as the token publisher does) and goes on to
launch step k+1's forward; the thread waits for the tokens, advances the matchers and fills
the bitmask (llguidance's parallel executor, GIL released) while the forward runs, and the
worker waits for it only right before step k+1 samples.  On CUDA the forward's kernels keep
the device busy meanwhile; on a CPU device the forward runs on the worker's own threads, so
the overlap is only what the cores left to the helper allow (see docs/DESIGN.md).

Matchers live with their requests across plans; a preempted request drops its matcher and a
resumed one replays its kept output into a fresh copy of the grammar's template matcher.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from tandem_serve.proto.guided_messages import GuidedGrammar

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.state import RequestState

log = logging.getLogger(__name__)


class GrammarRegistry:
    """Grammar templates by id, and the tokenizer and threads their matchers share."""

    def __init__(self, model_dir: str, vocab_size: int, device: torch.device) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.device = device
        self._templates: dict[str, Any] = {}  # id -> LLMatcher at the grammar's start
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built at the first grammar
        self._executor: Any = None  # llguidance.LLExecutor: masks of many rows in parallel
        self._thread: ThreadPoolExecutor | None = None

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance

            from tandem_serve.tokenization.tokenizer import Tokenizer

            tok = Tokenizer.from_dir(self.model_dir)
            # Ids past the tokenizer (a padded embedding) exist but are never allowed.
            self._tokenizer = llguidance.LLTokenizer(
                tok.raw.to_str(), n_vocab=max(self.vocab_size, len(tok)),
                eos_token=tok.eos_token_ids)
            threads = min(4, len(os.sched_getaffinity(0)))
            self._executor = llguidance.LLExecutor(num_threads=threads)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._tokenizer

    def add(self, grammar: GuidedGrammar) -> None:
        import llguidance

        tokenizer = self._llg_tokenizer()
        template = llguidance.LLMatcher(
            tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark), log_level=0)
        if template.is_error():  # the frontend validated it: not expected; its rows end at once
            log.error("grammar %s does not compile: %s", grammar.grammar_id,
                      template.get_error())
        self._templates[grammar.grammar_id] = template

    def drop(self, grammar_id: str) -> None:
        self._templates.pop(grammar_id, None)

    def matcher(self, grammar_id: str, output: list[int]) -> Any:
        """A matcher that has consumed `output` (a resumed request's kept tokens)."""
        template = self._templates.get(grammar_id)
        if template is None:
            raise KeyError(f"grammar {grammar_id} is not at the worker: a plan must send it "
                           f"before a request that uses it decodes")
        matcher = template.deep_copy()
        _consume(matcher, output)
        return matcher

    def rows(self, lo: int, reqs: list[RequestState]) -> GrammarRows:
        """The grammar rows [lo, lo + len(reqs)) of a plan's decode batch."""
        assert self._thread is not None and self._executor is not None
        return GrammarRows(lo, reqs, self.vocab_size, self._tokenizer.vocab_size,
                           self.device, self._thread, self._executor)


def _consume(matcher: Any, tokens: list[int]) -> None:
    for tok in tokens:
        # A stopped matcher (complete, or failed) only allows EOS from now on: like the
        # table's DONE state, it needs no more tokens.
        if matcher.is_stopped():
            return
        if not matcher.consume_token(int(tok)):
            log.warning("grammar matcher rejected token %d: %s", tok, matcher.get_error())


def _stop_columns(reqs: list[RequestState]) -> np.ndarray:
    """[G, S] stop ids of the rows, padded with each row's first (a repeated column is
    harmless: they are only cleared); rows without stop ids point at token 0."""
    width = max(1, max(len(r.sampling.stop_token_ids) for r in reqs))
    out = np.zeros((len(reqs), width), dtype=np.int64)
    for j, r in enumerate(reqs):
        ids = r.sampling.stop_token_ids
        if ids:
            out[j] = ids + [ids[0]] * (width - len(ids))
    return out


class GrammarRows:
    """The grammar rows [lo, hi) of one plan: their matchers, the helper thread's queue, and
    the mask of the step about to sample."""

    def __init__(self, lo: int, reqs: list[RequestState], vocab_size: int, llg_vocab: int,
                 device: torch.device, thread: ThreadPoolExecutor, executor: Any) -> None:
        self.lo, self.hi = lo, lo + len(reqs)
        self.matchers = [r.matcher for r in reqs]
        self.vocab_size = vocab_size
        self.device = device
        self._cuda = device.type == "cuda"
        self._executor = executor
        self._thread = thread
        words = (llg_vocab + 31) // 32
        # Two host buffers: the helper fills one while the other may still be uploading.
        self._buffers = [torch.empty((len(reqs), words), dtype=torch.int32,
                                     pin_memory=self._cuda) for _ in range(2)]
        # Bit j of byte b forbids token 8b + j when clear: a [256, 8] lookup of 0 / -inf
        # biases unpacks a byte per row gathered (2-3x faster than shifting every word by
        # 0..31), and adding the bias is cheaper than a masked_fill_.
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        self._unpack = torch.where(bits == 0, float("-inf"), 0.0).to(device)
        self._stops = None
        if any(r.sampling.min_new_tokens > 0 for r in reqs):
            self._stops = torch.from_numpy(_stop_columns(reqs)).to(device)
        self.bias: Tensor | None = None  # this step's [G, V] bias: -inf = forbidden, else 0
        self._bias_buf = torch.empty(len(reqs) * words * 4, 8, device=device)
        self._next = 0  # buffer of the next mask
        self._pending: Future[int | None] = thread.submit(self._fill, 0)

    # ---------------------------------------------------------------- main thread

    def prepare(self, may_block: Tensor | None) -> None:
        """This step's mask from the helper (waits for it), and which rows min_new_tokens may
        hold back from their stop ids."""
        index = self._pending.result()
        assert index is not None, "a mask was asked for after the plan's last step"
        words = self._buffers[index].to(self.device, non_blocking=True)
        rows = words.shape[0]
        by_byte = words.view(torch.uint8).view(-1).to(torch.int32)
        bias = torch.index_select(self._unpack, 0, by_byte, out=self._bias_buf)
        self.bias = bias.view(rows, -1)[:, : self.vocab_size]
        if self._stops is not None and may_block is not None:
            allowed = (self.bias == 0).scatter_(1, self._stops, False)
            may_block[self.lo: self.hi] = allowed.any(dim=1)

    def apply_(self, logits: Tensor) -> None:
        assert self.bias is not None, "prepare() comes first"
        logits[self.lo: self.hi].add_(self.bias)

    def submit(self, tokens: Tensor, last: bool) -> None:
        """Queue step k's tokens: the helper advances the matchers and, unless it was the
        plan's last step, fills step k+1's mask.  Reads no device value here."""
        mine = tokens[self.lo: self.hi]
        event = None
        if self._cuda:
            host = torch.empty(mine.shape, dtype=mine.dtype, pin_memory=True)
            host.copy_(mine, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            mine = host
        self._next ^= 1
        target = None if last else self._next
        self._pending = self._thread.submit(self._advance, mine, event, target)

    def wait(self) -> None:
        """The plan is over: every token consumed (the matchers are the host's again)."""
        self._pending.result()

    # ---------------------------------------------------------------- helper thread

    def _advance(self, tokens: Tensor, event: Any, target: int | None) -> int | None:
        if event is not None:
            event.synchronize()
        # On CPU the tensor was complete when the step returned and is never written again.
        for matcher, tok in zip(self.matchers, tokens.numpy().tolist(), strict=True):
            if tok >= 0:
                _consume(matcher, [tok])
        return None if target is None else self._fill(target)

    def _fill(self, index: int) -> int:
        from llguidance.numpy import fill_next_token_bitmask_par

        buf = self._buffers[index].numpy()
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in
                                                     enumerate(self.matchers)], buf)
        return index
