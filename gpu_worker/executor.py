"""One step's work on the device: the forward (decode rows, with a step's prefill pieces in
the same forward when it has some), sampling, recording what was sampled, finish checks.

A plain step is `StepExecutor.step`; a verify step (`gpu_worker.spec.verify`) calls the
same pieces (`logits`, `sample`, `record`) around its drafts.  Nothing here reads a device
value back to the host: sampled ids become the next step's inputs on the device, positions
and slot mappings advance there, and rows that finish are masked.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem_serve.gpu_worker.attention.base import AttentionMetadata, StateRows
from tandem_serve.gpu_worker.attention.kv_cache import KVCache
from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors
from tandem_serve.gpu_worker.graphs.piecewise import MixedGraphs, mixed_forward
from tandem_serve.gpu_worker.lora import LoraContext, LoraWeights
from tandem_serve.gpu_worker.models.decoder import CausalLM
from tandem_serve.gpu_worker.models.hybrid.model import HybridLM
from tandem_serve.gpu_worker.sampling import prompt_logprobs
from tandem_serve.gpu_worker.sampling.sampler import Sampler, SamplerOutput
from tandem_serve.gpu_worker.spec.batch import VerifyRows
from tandem_serve.gpu_worker.steps import (
    Piece,
    PrefillInputs,
    mixed_metadata,
    prefill_inputs,
    prefill_metadata,
)
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import PromptDetail

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.graphs.decode import GraphStep
    from tandem_serve.gpu_worker.publisher import TokenPublisher
    from tandem_serve.gpu_worker.vision.inputs import VisionInputs

# Prompt logprobs of a forward's pieces, still on the device, and what makes the messages.
Scores = tuple[list[torch.Tensor], Callable[[list[np.ndarray]], list[PromptDetail]]]


class StepExecutor:
    """Forwards, sampling and finish checks over the model and its paged KV cache."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int,
                 max_model_len: int, lora: LoraWeights | None,
                 mixed_graphs: MixedGraphs | None, vision: VisionInputs | None = None
                 ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.vision = vision  # a VL model's image embeddings and M-RoPE positions
        self.block_size, self.max_model_len = block_size, max_model_len
        self.device = kv_caches[0][0].device
        self.lora = lora
        # Mixed steps: every part of the forward but attention from graphs (None: eager).
        self.mixed_graphs = mixed_graphs
        self.sampler = Sampler()
        # Hybrid models' recurrent states: a verify step commits each row's accepted run.
        self.states = model.states if isinstance(model, HybridLM) else None

    def lora_context(self, slots: list[int]) -> LoraContext | None:
        return self.lora.context(slots) if self.lora is not None else None

    # ------------------------------------------------------------------ forwards

    @torch.inference_mode()
    def prefill(self, pieces: list[Piece], publish: TokenPublisher) -> None:
        """Chunks in one forward of their own, before a plan's steps (the `--prefill-phase`
        baseline, and a plan with no decode row); their prompt logprobs are queued."""
        inp = prefill_inputs(pieces, self.block_size, self.device,
                             history_lens=self.model.uses_history_lens,
                             state_span=self.states.span if self.states else 0)
        if self.vision is not None:
            self.vision.attach(inp, pieces)
        hidden = self.model(inp.ids, inp.positions, self.kv_caches, prefill_metadata(inp),
                            self.lora_context(inp.token_slots), inp.history_lens, inp.mm)
        if inp.scores.rows:
            publish.send_scores(*self.scores(hidden, inp))

    def scores(self, hidden: torch.Tensor, inp: PrefillInputs) -> Scores:
        return (prompt_logprobs.score_tensors(self.model, hidden, inp.scores),
                partial(prompt_logprobs.messages, inp.scores))

    def step_inputs(self, pieces: list[Piece], b: DecodeBatch,
                    decode_slots: list[int]) -> PrefillInputs:
        """A step's prefill pieces on the device, with the step's adapter rows."""
        inp = prefill_inputs(pieces, self.block_size, self.device, len(decode_slots),
                             b.block_tables.shape[1], self.model.uses_history_lens,
                             state_span=self.states.span if self.states else 0)
        inp.lora = self.lora_context(decode_slots + inp.token_slots)
        if self.vision is not None:
            self.vision.attach(inp, pieces)
        return inp

    def decode_slots(self, positions: torch.Tensor, active: torch.Tensor,
                     block_tables: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        # A row masked after finishing may sit one past its last block: clamp its lookup.
        index = (positions // bs).clamp_(max=block_tables.shape[1] - 1).unsqueeze(1)
        block = block_tables.gather(1, index).squeeze(1)
        return torch.where(active, block.to(torch.int64) * bs + positions % bs, -1)

    def forward_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       active: torch.Tensor, block_tables: torch.Tensor,
                       max_seq_len: int, lora: LoraContext | None = None,
                       row_lens: list[int] | None = None,
                       rope_delta: torch.Tensor | None = None,
                       states: StateRows | None = None) -> torch.Tensor:
        """Logits [B, V] of one decode forward; masked rows write the scratch block only.
        `row_lens`: host bounds of each row's context (rows far apart gather apart);
        `rope_delta`: an M-RoPE model's per-row offset of the rotary position; `states`: a
        hybrid model's rows' recurrent-state slots."""
        slots = self.decode_slots(positions, active, block_tables)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=block_tables,
            seq_lens=(positions + 1).to(torch.int32), query_start_loc=None, query_lens=None,
            max_seq_len=max_seq_len, is_decode=True, decode_lens=row_lens,
            states=states)
        rope = positions if rope_delta is None else positions + rope_delta
        hidden = self.model(input_ids, rope, self.kv_caches, meta, lora)
        return self.model.compute_logits(hidden)

    def forward_mixed(self, b: DecodeBatch | VerifyRows, step: int, pre: PrefillInputs
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the decode rows and a step's prefill pieces: the decode rows'
        logits [B, V] and the pieces' hidden states (on CUDA all but attention replayed
        from piecewise graphs, `gpu_worker.graphs.piecewise`)."""
        slots = self.decode_slots(b.positions, b.active, b.block_tables)
        meta = mixed_metadata(slots, b.positions, b.block_tables, b.max_seq_len(step), pre,
                              b.states)
        meta.decode_lens = b.row_lens(step)
        ids = torch.cat((b.input_ids, pre.ids))
        positions, mm = self._mixed_positions(b, pre)
        history = None
        if pre.history_lens is not None:  # a decode row's history ends at its position
            history = torch.cat((b.positions + 1, pre.history_lens))
        hidden = mixed_forward(self.mixed_graphs, self.model, ids, positions, self.kv_caches,
                               meta, pre.lora, history, mm)
        return self.model.compute_logits(hidden[: b.size]), hidden[b.size:]

    @staticmethod
    def _mixed_positions(b: DecodeBatch | VerifyRows, pre: PrefillInputs
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A mixed forward's rotary positions (decode rows first) and image rows (shifted
        past the decode rows)."""
        rows = b.positions if b.rope_delta is None else b.positions + b.rope_delta
        mm = None if pre.mm is None else (pre.mm[0] + b.size, pre.mm[1])
        if pre.positions.dim() == 2:  # M-RoPE: a decode row's axes are all equal
            return torch.cat((rows.expand(3, -1), pre.positions), dim=1), mm
        return torch.cat((rows, pre.positions)), mm

    def logits(self, b: DecodeBatch | VerifyRows, step: int, pre: PrefillInputs | None,
               lora: LoraContext | None, graph: GraphStep | None = None
               ) -> tuple[torch.Tensor, Any]:
        """The decode rows' logits, and the prompt detail of the step's prefill pieces."""
        if pre is not None:
            logits, hidden = self.forward_mixed(b, step, pre)
            return logits, self.scores(hidden, pre) if pre.scores.rows else None
        if graph is not None:
            assert isinstance(b, DecodeBatch)
            return graph(b), None
        return self.forward_decode(b.input_ids, b.positions, b.active, b.block_tables,
                                   b.max_seq_len(step), lora, b.row_lens(step),
                                   b.rope_delta, b.states), None

    # ------------------------------------------------------------------ after the forward

    def step(self, b: DecodeBatch, step: int, graph: GraphStep | None, last: bool,
             pre: PrefillInputs | None) -> StepTensors:
        """A plain step: forward, sample, record, check finishes, advance on the device."""
        logits, details = self.logits(b, step, pre, b.lora, graph)
        out = self.sample(b, logits)
        tok = torch.where(b.active, out.token_ids, -1)
        finish = self.finish_reasons(b, tok)
        self.record(b, tok, last)
        b.output_count += b.active.to(torch.int32)
        b.input_ids = torch.where(b.active, tok, b.input_ids)
        b.positions = b.positions + b.active.to(torch.int64)
        b.active = b.active & (finish == 0)
        return StepTensors(step, tok, finish, out.logprobs, out.ranks, out.top_ids,
                           out.top_logprobs, details)

    def sample(self, b: DecodeBatch, logits: torch.Tensor) -> SamplerOutput:
        # Guided rows' masks after the forward is under way (grammar rows wait for the host).
        may_block = b.guided.prepare() if b.guided is not None else None
        return self.sampler(logits, b.sampling, b.output_count, inplace=True,
                            may_block=may_block,
                            mask=b.guided.apply_ if b.guided is not None else None)

    @staticmethod
    def record(b: DecodeBatch, tok: torch.Tensor, last: bool) -> None:
        """A sampled token (-1: masked row) into the guided states and penalty tables."""
        if b.guided is not None:
            b.guided.advance(tok, b.active, last)
        seen, counts = b.sampling.seen, b.sampling.counts
        if seen is not None:
            # Masked rows write False into their own row only; they never sample again.
            seen.scatter_(1, tok.clamp(min=0).unsqueeze(1), b.active.unsqueeze(1))
        if counts is not None:  # masked rows add 0
            counts.scatter_add_(1, tok.clamp(min=0).unsqueeze(1),
                                b.active.to(counts.dtype).unsqueeze(1))

    def finish_reasons(self, b: DecodeBatch, tok: torch.Tensor) -> torch.Tensor:
        count = b.output_count + 1
        is_stop = (tok.unsqueeze(1) == b.stop_ids).any(dim=1)
        hit_max = count >= b.max_new
        # The new token makes the history positions+2 long.
        hit_len = b.positions + 2 >= self.max_model_len
        reason = torch.where(
            is_stop, int(FinishReason.EOS_TOKEN),
            torch.where(hit_max, int(FinishReason.MAX_TOKENS),
                        torch.where(hit_len, int(FinishReason.TOKEN_LIMIT), 0)))
        return torch.where(b.active, reason, 0).to(torch.uint8)
