"""The model runner: applies a plan's deltas, then runs its K steps on the device, each one
forward over the decoding rows and the prefill chunk pieces the plan put in that step
(`gpu_worker.steps`).

Inside the K-step loop nothing is read back to the host: sampled ids become the next
step's inputs on the device, positions and slot mappings advance there, rows that finish
are masked, and rows whose prompt is still prefilling are masked until their last piece's
step.  Each step's tokens leave through `publish` (on CUDA via pinned memory and a copy
event, see `gpu_worker.publisher`), while the next step is already computing.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem_serve.adapters.peft import AdapterError, ModelShapes
from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import (
    allocate_kv_cache,
    blocks_for,
    resolve_kv_dtype,
)
from tandem_serve.gpu_worker.attention.registry import check_backend, select_backend
from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors, build_decode_batch
from tandem_serve.gpu_worker.constrain.tables import GuidedRegistry
from tandem_serve.gpu_worker.graphs.piecewise import MIXED_GRAPH_TOKENS, MixedGraphs, mixed_forward
from tandem_serve.gpu_worker.lora import LoraContext, LoraWeights, tensor_parallel_split
from tandem_serve.gpu_worker.models.loader import load_model, load_model_args
from tandem_serve.gpu_worker.publisher import publish_step
from tandem_serve.gpu_worker.sampling import prompt_logprobs
from tandem_serve.gpu_worker.sampling.sampler import Sampler, SamplerOutput
from tandem_serve.gpu_worker.spec.batch import VerifyRows, verify_slots
from tandem_serve.gpu_worker.spec.draft_model import load_draft
from tandem_serve.gpu_worker.spec.policy import make_speculation
from tandem_serve.gpu_worker.spec.verify import verify_step
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.gpu_worker.steps import (
    Piece,
    PrefillInputs,
    StepWork,
    lay_out,
    mixed_metadata,
    prefill_inputs,
    prefill_metadata,
)
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto.messages import (
    AdapterFailed,
    FinishReason,
    NewRequest,
    PromptDetail,
    StepDone,
    StepPlan,
)
from tandem_serve.proto.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs, GraphStep
    from tandem_serve.gpu_worker.parallel import TensorParallel
    from tandem_serve.gpu_worker.publisher import TokenPublisher

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # float32 on CPU: bf16 matmuls there are slower and parity tests compare in fp32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ModelRunner:
    def __init__(self, model_dir: str, *, device: str = "auto", dtype: str = "auto",
                 block_size: int = 16, num_kv_blocks: int = 0, kv_cache_memory: float = 0.0,
                 kv_cache_dtype: str = "auto",
                 max_model_len: int = 0, max_num_seqs: int = 64,
                 cuda_graphs: bool = True, onednn: bool = True,
                 flash_attn: bool = True, attention_backend: str = "auto",
                 tp: TensorParallel | None = None,
                 adapter_cache: str = "", max_loras: int = 0, max_lora_rank: int = 16,
                 load_format: str = "auto", speculative: SpeculativeConfig | None = None
                 ) -> None:
        self.device = tp.device if tp is not None else resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        check_backend(attention_backend, self.device, self.dtype, self.kv_dtype, block_size)
        t0 = time.monotonic()
        # Under tensor parallelism (`tp`), this rank's shard, joined to the others' shards.
        self.model = load_model(model_dir, self.dtype, self.device, onednn,
                                shard=tp.shard if tp is not None else None,
                                load_format=load_format)
        if tp is not None:
            tp.install(self.model)
        cfg = self.model.config
        log.info("model loaded in %.2f s (%s, %s, %s)", time.monotonic() - t0,
                 cfg.architecture, self.dtype, self.device)
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        # Where LongRoPE switches factors (0: not a LongRoPE model); the scheduler's prefix
        # cache must know (WorkerReady.long_rope_from).
        self.long_rope_from = (cfg.rope_original_max_position_embeddings or 0) \
            if cfg.rope_type == "longrope" else 0
        self.block_size = block_size
        # Speculation's draft model (None: not that method), its KV blocks mirroring ours.
        self.draft = load_draft(speculative, cfg.vocab_size, self.dtype, self.device, onednn,
                                load_format)
        self.num_blocks = num_kv_blocks or blocks_for(
            cfg, block_size, self.kv_dtype, kv_cache_memory, max_num_seqs, self.max_model_len,
            self.draft.kv_bytes_per_block(block_size, self.kv_dtype) if self.draft else 0)
        if tp is not None:  # one block table serves every rank: the scheduler's count fits all
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_caches = allocate_kv_cache(cfg.num_layers, self.num_blocks, block_size,
                                           cfg.num_kv_heads, cfg.head_dim, self.kv_dtype,
                                           self.device)
        # One attention backend (the draft's too); any fallback is decided and logged here.
        self.attention = self.model.attention = select_backend(
            attention_backend, self.device, self.dtype, self.kv_dtype, block_size,
            flash_attn=flash_attn, warm_up=self.model.attention_warm_up(self.kv_caches[0]))
        if self.draft is not None:
            self.draft.allocate(self.num_blocks, block_size, self.kv_dtype, self.attention)
        log.info("KV cache: %d blocks of %d tokens, %s, %.1f MiB", self.num_blocks, block_size,
                 str(self.kv_dtype).removeprefix("torch."),
                 sum(t.nbytes for kv in self.kv_caches for t in kv) / 2**20)
        # LoRA adapter slots (gpu_worker.lora); None: adapters off, every row is the base.
        self.lora: LoraWeights | None = None
        if adapter_cache and max_loras > 0:
            whole = load_model_args(model_dir)  # cfg is this rank's part under TP
            tp_split = (tensor_parallel_split(whole, tp.shard)
                        if tp is not None and tp.shard.size > 1 else None)
            self.lora = LoraWeights(ModelShapes.of(cfg), adapter_cache, max_loras,
                                    max_lora_rank, self.dtype, self.device, tp_split,
                                    ModelShapes.of(whole), cfg.moe_layers)
            log.info("LoRA: %d adapter slots of rank <= %d (%.1f MiB)", max_loras,
                     max_lora_rank, self.lora.nbytes / 2**20)
        self._adapter_failures: list[AdapterFailed] = []
        self.sampler = Sampler()
        # Constraint tables (on the device) and grammars (host matchers) the plans sent.
        self.guided = GuidedRegistry(self.device, self.vocab_size, model_dir)
        self.requests: dict[int, RequestState] = {}
        self._details: list[PromptDetail] = []  # prompt detail waiting to be published
        # Wraps the K-step loop; tests set it to sync_guard.forbid_host_sync.
        self.step_guard: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
        self._step_s = 0.0  # the last decode step's time (paced planning's yardstick)
        # Speculative decoding (None: off); verify steps run eager, plain steps may use graphs.
        self.speculation = make_speculation(speculative, self.forward_decode, self.device,
                                            self.max_model_len, block_size,
                                            tp.max_float if tp is not None else None, self.draft)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda" and self.attention.decode_graphs:
            from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs

            self.graphs = DecodeGraphs(self.forward_decode, max_num_seqs,
                                       -(-self.max_model_len // block_size), block_size,
                                       self.device,
                                       self.lora.full_context if self.lora else None)
        # Mixed steps: every part of the forward but attention from graphs (one rank only).
        self.mixed_graphs = (MixedGraphs(self.model, MIXED_GRAPH_TOKENS + max_num_seqs, True)
                             if self.graphs is not None and (tp is None or tp.shard.size == 1)
                             else None)

    # ------------------------------------------------------------------ deltas

    def apply(self, plan: StepPlan) -> None:
        for rid in plan.drop:
            self.requests.pop(rid, None)
        for rid in plan.preempt:
            req = self.requests.get(rid)
            if req is not None:
                req.block_ids, req.num_computed, req.prefill_chunk, req.draft_len = [], 0, 0, 0
                req.prefill_steps = []
                self.guided.pause(req)
        # Requests dropped first: a table no request uses any more may go in the same plan.
        self.guided.apply(plan.tables, plan.drop_tables)
        self._load_adapters(plan)  # into slots no remaining request uses
        for new in plan.new:
            self._add(new)
        self._fail_unloaded(plan)
        for cont in plan.cont:
            req = self.requests.get(cont.request_id)
            if req is not None:
                req.block_ids.extend(cont.new_block_ids)
                req.prefill_chunk = cont.num_prefill_tokens
                req.prefill_steps = list(cont.prefill_steps)

    def _add(self, new: NewRequest) -> None:
        req = self.requests.get(new.request_id)
        if new.resume and req is not None:
            req.block_ids = list(new.block_ids)
        else:
            assert new.sampling is not None, "a new request carries its sampling params"
            prompt = [int(t) for t in new.prompt_ids]
            req = RequestState(new.request_id, prompt, len(prompt), new.sampling,
                               list(new.block_ids), lora_slot=new.lora_slot)
            self.requests[new.request_id] = req
            if new.sampling.prompt_logprobs and len(prompt) == 1:
                self._details.append(prompt_logprobs.empty_detail(req))
        req.num_computed = new.num_cached_tokens
        req.prefill_chunk = new.num_prefill_tokens
        req.prefill_steps = list(new.prefill_steps)
        self.guided.start(req)  # fresh: the initial state; resumed: its output replayed

    def _load_adapters(self, plan: StepPlan) -> None:
        for load in plan.adapters:
            if self.lora is None:
                continue  # the requests using it fail in _fail_unloaded
            try:
                self.lora.load(load.slot, load.adapter_id)
            except AdapterError as exc:
                log.warning("plan %d: %s", plan.plan_id, exc)

    def _fail_unloaded(self, plan: StepPlan) -> None:
        """Requests whose adapter slot holds no adapter (its load failed) never run: they
        finish with ERROR and the scheduler hears why (AdapterFailed, before StepDone)."""
        by_slot: dict[int, list[int]] = {}
        for new in plan.new:
            req = self.requests.get(new.request_id)
            if req is None or req.finished or not req.lora_slot:
                continue
            if self.lora is not None and req.lora_slot not in self.lora.failed:
                continue
            req.finished = FinishReason.ERROR
            by_slot.setdefault(req.lora_slot, []).append(req.request_id)
        for slot, rids in by_slot.items():
            error = self.lora.failed.get(slot) if self.lora is not None else None
            message = str(error) if error else (
                "LoRA adapters are not enabled on the gpu worker (--adapter-cache)")
            adapter_id = error.adapter_id if error else ""
            self._adapter_failures.append(
                AdapterFailed(plan.plan_id, adapter_id, slot, message, rids))
            self._details = [d for d in self._details if d.request_id not in rids]

    def take_adapter_failures(self) -> list[AdapterFailed]:
        failures, self._adapter_failures = self._adapter_failures, []
        return failures

    def _lora_context(self, slots: list[int]) -> LoraContext | None:
        return self.lora.context(slots) if self.lora is not None else None

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def prefill(self, pieces: list[Piece], publish: TokenPublisher) -> None:
        """Chunks in one forward of their own, before a plan's steps (the `--prefill-phase`
        baseline, and a plan with no decode row); their prompt logprobs are queued."""
        inp = prefill_inputs(pieces, self.block_size, self.device,
                             history_lens=self.model.uses_history_lens)
        hidden = self.model(inp.ids, inp.positions, self.kv_caches, prefill_metadata(inp),
                            self._lora_context(inp.token_slots), inp.history_lens)
        if inp.scores.rows:
            publish.send_scores(*self._scores(hidden, inp))

    def _scores(self, hidden: torch.Tensor, inp: PrefillInputs
                ) -> tuple[list[torch.Tensor], Callable[[list[np.ndarray]], list[PromptDetail]]]:
        return (prompt_logprobs.score_tensors(self.model, hidden, inp.scores),
                partial(prompt_logprobs.messages, inp.scores))

    def _step_inputs(self, pieces: list[Piece], b: DecodeBatch,
                     decode_slots: list[int]) -> PrefillInputs:
        """A step's prefill pieces on the device, with the step's adapter rows."""
        inp = prefill_inputs(pieces, self.block_size, self.device, len(decode_slots),
                             b.block_tables.shape[1], self.model.uses_history_lens)
        inp.lora = self._lora_context(decode_slots + inp.token_slots)
        return inp

    def _decode_slots(self, positions: torch.Tensor, active: torch.Tensor,
                      block_tables: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        # A row masked after finishing may sit one past its last block: clamp its lookup.
        index = (positions // bs).clamp_(max=block_tables.shape[1] - 1).unsqueeze(1)
        block = block_tables.gather(1, index).squeeze(1)
        return torch.where(active, block.to(torch.int64) * bs + positions % bs, -1)

    def forward_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       active: torch.Tensor, block_tables: torch.Tensor,
                       max_seq_len: int, lora: LoraContext | None = None,
                       row_lens: list[int] | None = None) -> torch.Tensor:
        """Logits [B, V] of one decode forward; masked rows write the scratch block only.
        `row_lens`: host bounds of each row's context (rows far apart gather apart)."""
        slots = self._decode_slots(positions, active, block_tables)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=block_tables,
            seq_lens=(positions + 1).to(torch.int32), query_start_loc=None, query_lens=None,
            max_seq_len=max_seq_len, is_decode=True, decode_lens=row_lens)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora)
        return self.model.compute_logits(hidden)

    def forward_mixed(self, b: DecodeBatch | VerifyRows, step: int, pre: PrefillInputs
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the decode rows and a step's prefill pieces: the decode rows'
        logits [B, V] and the pieces' hidden states (on CUDA all but attention replayed
        from piecewise graphs, `gpu_worker.graphs.piecewise`)."""
        slots = self._decode_slots(b.positions, b.active, b.block_tables)
        meta = mixed_metadata(slots, b.positions, b.block_tables, b.max_seq_len(step), pre)
        meta.decode_lens = b.row_lens(step)
        ids, positions = torch.cat((b.input_ids, pre.ids)), torch.cat((b.positions, pre.positions))
        history = None
        if pre.history_lens is not None:  # a decode row's history ends at its position
            history = torch.cat((b.positions + 1, pre.history_lens))
        hidden = mixed_forward(self.mixed_graphs, self.model, ids, positions, self.kv_caches,
                               meta, pre.lora, history)
        return self.model.compute_logits(hidden[: b.size]), hidden[b.size:]

    @torch.inference_mode()
    def decode_step(self, b: DecodeBatch, step: int, graph: GraphStep | None = None,
                    last: bool = False, pre: PrefillInputs | None = None) -> StepTensors:
        """One forward + sample for every row, with the step's prefill pieces `pre` in the
        same forward; no host reads (grammar rows aside: their mask waits for the host's
        matchers, see `gpu_worker.constrain.grammar`)."""
        joining = b.joins.get(step)
        if joining is not None:  # their last prefill piece runs in this step
            b.active = b.active | joining
        if b.spec is not None:
            return verify_step(b, step, pre, partial(self._logits, lora=b.lora),
                               self._sample, self.sampler, partial(self._record, last=last),
                               self.max_model_len)
        logits, details = self._logits(b, step, pre, b.lora, graph)
        out = self._sample(b, logits)
        tok = torch.where(b.active, out.token_ids, -1)
        finish = self._finish_reasons(b, tok)
        self._record(b, tok, last)
        b.output_count += b.active.to(torch.int32)
        b.input_ids = torch.where(b.active, tok, b.input_ids)
        b.positions = b.positions + b.active.to(torch.int64)
        b.active = b.active & (finish == 0)
        return StepTensors(step, tok, finish, out.logprobs, out.ranks, out.top_ids,
                           out.top_logprobs, details)

    def _logits(self, b: DecodeBatch | VerifyRows, step: int, pre: PrefillInputs | None,
                lora: LoraContext | None, graph: GraphStep | None = None
                ) -> tuple[torch.Tensor, Any]:
        """The decode rows' logits, and the prompt detail of the step's prefill pieces."""
        if pre is not None:
            logits, hidden = self.forward_mixed(b, step, pre)
            return logits, self._scores(hidden, pre) if pre.scores.rows else None
        if graph is not None:
            assert isinstance(b, DecodeBatch)
            return graph(b), None
        return self.forward_decode(b.input_ids, b.positions, b.active, b.block_tables,
                                   b.max_seq_len(step), lora, b.row_lens(step)), None

    def _sample(self, b: DecodeBatch, logits: torch.Tensor) -> SamplerOutput:
        # Guided rows' masks after the forward is under way (grammar rows wait for the host).
        may_block = b.guided.prepare() if b.guided is not None else None
        return self.sampler(logits, b.sampling, b.seen, b.output_count,
                            all_greedy=b.all_greedy, any_penalty=b.any_penalty,
                            need_logprobs=b.need_logprobs, max_top_n=b.max_top_n,
                            hints=b.hints, inplace=True, counts=b.counts, may_block=may_block,
                            mask=b.guided.apply_ if b.guided is not None else None)

    @staticmethod
    def _record(b: DecodeBatch, tok: torch.Tensor, last: bool) -> None:
        """A sampled token (-1: masked row) into the guided states and penalty tables."""
        if b.guided is not None:
            b.guided.advance(tok, b.active, last)
        if b.seen is not None:
            # Masked rows write False into their own row only; they never sample again.
            b.seen.scatter_(1, tok.clamp(min=0).unsqueeze(1), b.active.unsqueeze(1))
        if b.counts is not None:  # masked rows add 0
            b.counts.scatter_add_(1, tok.clamp(min=0).unsqueeze(1),
                                  b.active.to(b.counts.dtype).unsqueeze(1))

    def _finish_reasons(self, b: DecodeBatch, tok: torch.Tensor) -> torch.Tensor:
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

    # ------------------------------------------------------------------ a whole plan

    def execute(self, plan: StepPlan, publish: TokenPublisher,
                ending: Callable[[], None] | None = None, lead_s: float = 0.0) -> StepDone:
        """Run one plan.  `ending`, when given, is called once about `lead_s` before the plan
        ends (paced planning: the scheduler then builds the next one)."""
        t0 = time.monotonic()
        with TRACER.span("apply", plan.plan_id):
            self.apply(plan)
        layout = lay_out(self.requests.values(), plan.num_steps, plan.prefill_phase)
        if ending is not None and not layout.decoding:  # no steps to time: ask now
            ending()
            ending = None
        for detail in self._details:  # before any token of theirs
            publish.send_detail(detail)
        self._details = []
        if layout.separate:
            with TRACER.span("prefill", plan.plan_id):
                self.prefill(layout.separate, publish)
        steps: list[StepTensors] = []
        batch: DecodeBatch | None = None
        if layout.decoding:
            spec = (self.speculation.plan(layout.decoding, plan.num_steps, self.block_size,
                                          self.device) if self.speculation else None)
            batch = build_decode_batch(layout.decoding, self.vocab_size, self.device,
                                       self.guided, layout.join_steps,
                                       spec.stride if spec else 1)
            batch.spec, batch.plan_id = spec, plan.plan_id
            slots = verify_slots(spec, [r.lora_slot for r in layout.decoding])
            batch.lora = self._lora_context(slots)
            graph = (self.graphs.for_plan(batch, plan.num_steps)
                     if self.graphs and spec is None else None)
            work = StepWork(layout.steps, layout.join_steps,
                            partial(self._step_inputs, b=batch, decode_slots=slots))
            with self.step_guard():
                steps = self._decode_loop(plan, batch, publish, graph, ending, lead_s, work)
        else:
            publish.end_of_plan(plan)
        publish.flush()
        forward_time = time.monotonic() - t0
        with TRACER.span("collect", plan.plan_id):
            done = self._collect(plan, layout.decoding, steps, batch)
        done.forward_time = forward_time
        done.wall_time = time.monotonic() - t0
        done.decode_only = bool(layout.decoding) and not layout.num_prefill
        if batch is not None and batch.spec is not None and self.speculation is not None:
            (done.num_drafts, done.num_draft_tokens, done.num_accepted_tokens,
             done.num_accepted_per_pos) = self.speculation.finish(batch.spec, layout.decoding)
        return done

    def _decode_loop(self, plan: StepPlan, batch: DecodeBatch, publish: TokenPublisher,
                     graph: GraphStep | None, ending: Callable[[], None] | None,
                     lead_s: float, work: StepWork) -> list[StepTensors]:
        """K steps back to back; publishing only queues device tensors (no host read)."""
        last = plan.num_steps - 1
        steps = []
        for k in range(plan.num_steps):
            # Latest step that still leaves `lead_s` of work, judged by the last step's time
            # (on CUDA, launch time: the notice then comes early, which only costs admission
            # latency, never an idle device).
            if ending is not None and (k == last or (last - k) * self._step_s < lead_s):
                ending()
                ending = None
            started = time.perf_counter()
            pre = work.inputs(plan.plan_id, k)
            # On CPU the span is the step's compute; on CUDA, its launch (kernels run async).
            with TRACER.span("forward", plan.plan_id, k):
                st = self.decode_step(batch, k, graph, k == last, pre)
            steps.append(st)
            if plan.publish_per_step:
                with TRACER.span("publish", plan.plan_id, k):
                    publish_step(publish, plan, batch, st, k == last)
            self._step_s = time.perf_counter() - started
        if not plan.publish_per_step:  # sync mode: the plan's tokens go out after its last step
            for st in steps:
                publish_step(publish, plan, batch, st, st.step == last)
        return steps

    def _collect(self, plan: StepPlan, decoding: list[RequestState], steps: list[StepTensors],
                 batch: DecodeBatch | None) -> StepDone:
        """The plan's one host read: append the tokens to the histories, count, report (and
        keep the guided rows' automaton states for the next plan)."""
        named = [n.request_id for n in plan.new] + [c.request_id for c in plan.cont]
        finished = [r for rid in named if (r := self.requests.get(rid)) and r.finished]
        counts = np.zeros(len(decoding), dtype=np.int32)
        if batch is not None and batch.guided is not None:
            states = batch.guided.state.cpu().numpy() if batch.guided.groups else None
            batch.guided.finish(decoding, states)
        if steps:
            toks = _columns([s.token_ids for s in steps])  # [K, B] ([K * (1 + k), B])
            fins = _columns([s.finish for s in steps])
            for i, r in enumerate(decoding):
                col = toks[:, i]
                valid = col[col >= 0]
                r.history.extend(int(t) for t in valid)
                r.num_computed += len(valid)
                counts[i] = len(valid)
                reasons = fins[:, i][fins[:, i] > 0]
                if len(reasons):
                    r.finished = FinishReason(int(reasons[0]))
                    finished.append(r)
        # A request named in a plan after it finished is reported again (the scheduler
        # ignores repeats); its state stays until the scheduler drops it.
        seen: dict[int, RequestState] = {r.request_id: r for r in finished}
        return StepDone(
            plan_id=plan.plan_id,
            request_ids=np.array([r.request_id for r in decoding], dtype=np.int64),
            num_tokens=counts,
            finished_ids=np.array(list(seen), dtype=np.int64),
            finish_reasons=np.array([int(r.finished) for r in seen.values()], dtype=np.uint8),
            forward_time=0.0, wall_time=0.0)


def _columns(per_step: list[torch.Tensor]) -> np.ndarray:
    """Per-step [B] or [B, 1 + k] tensors as one host array [tokens in order, B]."""
    return torch.cat([t.reshape(t.shape[0], -1).T for t in per_step]).cpu().numpy()
