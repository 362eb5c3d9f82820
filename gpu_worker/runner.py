"""The model runner: a rank's model, KV cache and adapters, and a plan's execution: apply
its deltas to the request table (`gpu_worker.request_table`), lay its work over its K steps
(`gpu_worker.steps`), run them back to back on the device through the step executor
(`gpu_worker.executor`; verify steps through `gpu_worker.spec.verify`), then read the
plan's tokens back once.

Inside the K-step loop nothing is read back to the host.  Each step's tokens leave through
`publish` (on CUDA via pinned memory and a copy event, see `gpu_worker.publisher`), while
the next step is already computing.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem_serve.adapters.peft import ModelShapes
from tandem_serve.gpu_worker.attention.kv_cache import (
    allocate_kv_cache,
    blocks_for,
    resolve_kv_dtype,
)
from tandem_serve.gpu_worker.attention.kv_offload import HostKvPool
from tandem_serve.gpu_worker.attention.registry import check_backend, select_backend
from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors, build_decode_batch
from tandem_serve.gpu_worker.constrain.tables import GuidedRegistry
from tandem_serve.gpu_worker.executor import StepExecutor
from tandem_serve.gpu_worker.graphs.piecewise import MIXED_GRAPH_TOKENS, MixedGraphs
from tandem_serve.gpu_worker.lora import LoraWeights, tensor_parallel_split
from tandem_serve.gpu_worker.models.decoder import CausalLM
from tandem_serve.gpu_worker.models.hybrid.model import HybridLM
from tandem_serve.gpu_worker.models.hybrid.state_cache import (
    SlotPool,
    StateCache,
    bytes_per_slot,
    checkpoint_span,
)
from tandem_serve.gpu_worker.models.loader import load_model, load_model_args
from tandem_serve.gpu_worker.publisher import publish_step
from tandem_serve.gpu_worker.request_table import RequestTable
from tandem_serve.gpu_worker.spec.batch import verify_slots
from tandem_serve.gpu_worker.spec.policy import make_speculation
from tandem_serve.gpu_worker.spec.registry import ProposerContext, make_proposer
from tandem_serve.gpu_worker.spec.verify import verify_step
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.gpu_worker.steps import PrefillInputs, StepWork, lay_out
from tandem_serve.gpu_worker.vision.inputs import VisionInputs
from tandem_serve.gpu_worker.vision.tower import VisionTower
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto.adapter_messages import AdapterFailed
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.plan_messages import StepDone, StepPlan
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.vision import VisionSpec, read_spec

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
    """A rank's model and cache (built from its `WorkerConfig`), the request table, the
    step executor, and the plan loop over them."""

    def __init__(self, cfg: WorkerConfig, tp: TensorParallel | None = None) -> None:
        self.device = tp.device if tp is not None else resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        # A backend that cannot serve here is a start-up error before any weight loads.
        check_backend(cfg.attention_backend, self.device, self.dtype, self.kv_dtype,
                      cfg.block_size)
        self.model = _load(cfg, self.dtype, self.device, tp)
        self.shard = tp.shard if tp is not None else None  # what a weight reload reads
        self.model_dir = cfg.model
        self.onednn = cfg.onednn
        mc = self.model.config
        _check_hybrid(cfg, mc.architecture if mc.is_hybrid else None,
                      tp.shard.size if tp is not None else 1)
        # Hybrid models: one recurrent-state slot per running request, out of the KV budget;
        # with prefix caching a state checkpoint per block too (speculation turns it off:
        # a verify step does not checkpoint).
        state_bytes = bytes_per_slot(mc, self.dtype) * (cfg.max_num_seqs + 1)
        checkpoints = mc.is_hybrid and cfg.prefix_caching and not cfg.speculative
        self.vocab_size = mc.vocab_size
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        # Where LongRoPE switches factors (0: not a LongRoPE model); the scheduler's prefix
        # cache must know (WorkerReady.long_rope_from).
        self.long_rope_from = (mc.rope_original_max_position_embeddings or 0) \
            if mc.rope_type == "longrope" else 0
        self.block_size = cfg.block_size
        # Speculation's proposer (None: off); a draft model's KV blocks mirror ours.
        self.proposer = make_proposer(cfg.speculative, ProposerContext(
            mc.vocab_size, self.dtype, self.device, cfg.onednn, cfg.load_format))
        self.num_blocks = cfg.num_kv_blocks or blocks_for(
            mc, cfg.block_size, self.kv_dtype, cfg.kv_cache_memory, cfg.max_num_seqs,
            self.max_model_len,
            (self.proposer.kv_bytes_per_block(cfg.block_size, self.kv_dtype)
             if self.proposer else 0)
            + (bytes_per_slot(mc, self.dtype) if checkpoints else 0), state_bytes)
        if tp is not None:  # one block table serves every rank: the scheduler's count fits all
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_caches = allocate_kv_cache(mc.num_attention_layers, self.num_blocks,
                                           cfg.block_size,
                                           mc.num_kv_heads, mc.head_dim, self.kv_dtype,
                                           self.device)
        # One attention backend (the draft's too); any fallback is decided and logged here.
        # Gemma 3's images attend both ways: only backends that can do that serve it.
        spec = read_spec(cfg.model) if mc.image_token_id >= 0 else None
        assert mc.image_token_id < 0 or spec is not None, "an image token has a vision spec"
        self.attention = self.model.attention = select_backend(
            cfg.attention_backend, self.device, self.dtype, self.kv_dtype, cfg.block_size,
            flash_attn=cfg.flash_attn, warm_up=self.model.attention_warm_up(self.kv_caches[0]),
            bidirectional=spec is not None and spec.bidirectional)
        if self.proposer is not None:
            self.proposer.allocate(self.num_blocks, cfg.block_size, self.kv_dtype,
                                   self.attention)
        log.info("KV cache: %d blocks of %d tokens, %s, %.1f MiB", self.num_blocks,
                 cfg.block_size, str(self.kv_dtype).removeprefix("torch."),
                 sum(t.nbytes for kv in self.kv_caches for t in kv) / 2**20)
        # The host KV tier (--kv-offloading-size): every KV tensor's blocks, the draft's too.
        self.host_pool = _host_pool(cfg, self.kv_caches, self.proposer, self.device)
        self.num_host_blocks = self.host_pool.num_slots if self.host_pool else 0
        if tp is not None:
            self.num_host_blocks = tp.min_int(self.num_host_blocks)
        self.slots: SlotPool | None = None
        # Prefix hits end on a multiple of this many blocks (0: no hits; see WorkerReady).
        self.state_checkpoint_blocks = (checkpoint_span(cfg.block_size) // cfg.block_size
                                        if checkpoints else 0)
        if isinstance(self.model, HybridLM):
            self.model.states = StateCache(mc, cfg.max_num_seqs, self.dtype, self.device,
                                           self.num_blocks if checkpoints else 0,
                                           cfg.block_size)
            self.slots = SlotPool(cfg.max_num_seqs)
            per_block = (f" and a checkpoint per KV block for prefix caching "
                         f"({bytes_per_slot(mc, self.dtype) / 2**20:.2f} MiB each; "
                         "--no-prefix-caching gives them to KV)") if checkpoints else ""
            log.info("recurrent states: %d slots%s, %.1f MiB", cfg.max_num_seqs, per_block,
                     self.model.states.nbytes / 2**20)
        self.lora = _adapters(cfg, self.model, self.dtype, self.device, tp)
        self.vision = None if spec is None else _vision(cfg, spec, self.dtype, self.device)
        # A VL model runs eager: its rotary positions carry a per-row offset and its prefill
        # image embeddings, which the captured graphs do not take. Hybrid models run eager
        # too (their state updates are not captured yet).
        graphs = (cfg.cuda_graphs and self.device.type == "cuda"
                  and self.attention.decode_graphs and self.vision is None
                  and not mc.is_hybrid)
        # Mixed steps: every part of the forward but attention from graphs (one rank only).
        mixed = (MixedGraphs(self.model, MIXED_GRAPH_TOKENS + cfg.max_num_seqs, True)
                 if graphs and (tp is None or tp.shard.size == 1) else None)
        self.executor = StepExecutor(self.model, self.kv_caches, cfg.block_size,
                                     self.max_model_len, self.lora, mixed, self.vision)
        self.table = RequestTable(GuidedRegistry(self.device, self.vocab_size, cfg.model),
                                  self.lora, self.proposer, self.slots)
        # Wraps the K-step loop; tests set it to sync_guard.forbid_host_sync.
        self.step_guard: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
        self._step_s = 0.0  # the last decode step's time (paced planning's yardstick)
        # Speculative decoding (None: off); verify steps run eager, plain steps may use graphs.
        self.speculation = make_speculation(cfg.speculative, self.proposer,
                                            self.executor.forward_decode, self.device,
                                            self.max_model_len, cfg.block_size,
                                            tp.max_float if tp is not None else None)
        self._cfg = cfg
        self.graphs: DecodeGraphs | None = None
        if graphs:
            # Before the worker reports ready: never a capture while streams wait.
            self.graphs = self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> DecodeGraphs:
        from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs

        cfg = self._cfg
        graphs = DecodeGraphs(self.executor.forward_decode, cfg.max_num_seqs,
                              -(-self.max_model_len // cfg.block_size), cfg.block_size,
                              self.device, self.lora.full_context if self.lora else None)
        graphs.capture_all(lora=self.lora is not None)
        return graphs

    def recapture_graphs(self) -> None:
        """Capture the graphs again after the weights or the KV cache moved (wake-up): a
        graph replays the buffers it was captured with."""
        if self.executor.mixed_graphs is not None:
            self.executor.mixed_graphs = MixedGraphs(
                self.model, MIXED_GRAPH_TOKENS + self._cfg.max_num_seqs, True)
        if self.graphs is not None:
            self.graphs = self._capture_decode_graphs()

    @property
    def requests(self) -> dict[int, RequestState]:
        return self.table.requests

    @property
    def guided(self) -> GuidedRegistry:
        return self.table.guided

    def apply(self, plan: StepPlan) -> None:
        self.table.apply(plan)

    def take_adapter_failures(self) -> list[AdapterFailed]:
        return self.table.take_adapter_failures()

    @torch.inference_mode()
    def decode_step(self, b: DecodeBatch, step: int, graph: GraphStep | None = None,
                    last: bool = False, pre: PrefillInputs | None = None) -> StepTensors:
        """One forward + sample for every row, with the step's prefill pieces `pre` in the
        same forward; no host reads (grammar rows aside: their mask waits for the host's
        matchers, see `gpu_worker.constrain.grammar`)."""
        b.join(step)
        if b.spec is not None:
            return verify_step(b, step, pre, self.executor, last)
        return self.executor.step(b, step, graph, last, pre)

    # ------------------------------------------------------------------ a whole plan

    def execute(self, plan: StepPlan, publish: TokenPublisher,
                ending: Callable[[], None] | None = None, lead_s: float = 0.0) -> StepDone:
        """Run one plan.  `ending`, when given, is called once about `lead_s` before the plan
        ends (paced planning: the scheduler then builds the next one)."""
        t0 = time.monotonic()
        with TRACER.span("apply", plan.plan_id):
            if self.host_pool is not None:  # before the forwards, in the plan's order
                self.host_pool.run(plan)
            self.table.apply(plan)
            self._restore_states(plan)
        layout = lay_out(self.requests.values(), plan.num_steps, plan.prefill_phase)
        if ending is not None and not layout.decoding:  # no steps to time: ask now
            ending()
            ending = None
        for detail in self.table.take_details():  # before any token of theirs
            publish.send_detail(detail)
        if layout.separate:
            with TRACER.span("prefill", plan.plan_id):
                self.executor.prefill(layout.separate, publish)
        steps: list[StepTensors] = []
        batch: DecodeBatch | None = None
        if layout.decoding:
            batch, slots = self._batch(plan, layout.decoding, layout.join_steps)
            graph = (self.graphs.for_plan(batch, plan.num_steps)
                     if self.graphs and batch.spec is None else None)
            work = StepWork(layout.steps, layout.join_steps,
                            partial(self.executor.step_inputs, b=batch, decode_slots=slots))
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

    def _restore_states(self, plan: StepPlan) -> None:
        """Hybrid models: a request added with a cached prefix starts from the state
        checkpointed at the prefix's last block (a hit ends on one: `state_checkpoint_blocks`),
        whether a piece or its first decode step reads it next."""
        states = self.model.states if isinstance(self.model, HybridLM) else None
        if states is None:
            return
        for new in plan.new:
            req = self.requests.get(new.request_id)
            if new.num_cached_tokens and req is not None and not req.finished:
                states.restore(req.state_slot,
                               req.block_ids[new.num_cached_tokens // self.block_size - 1])

    def _batch(self, plan: StepPlan, decoding: list[RequestState], join_steps: list[int]
               ) -> tuple[DecodeBatch, list[int]]:
        """The plan's decoding rows on the device, with its speculation and adapters; and
        the adapter slot of each of its forward's decode rows (verify rows included)."""
        spec = (self.speculation.plan(decoding, plan.num_steps, self.block_size, self.device)
                if self.speculation else None)
        batch = build_decode_batch(decoding, self.vocab_size, self.device, self.guided,
                                   join_steps, spec.stride if spec else 1)
        batch.spec, batch.plan_id = spec, plan.plan_id
        if self.vision is not None:
            batch.rope_delta = self.vision.deltas(decoding)
        slots = verify_slots(spec, [r.lora_slot for r in decoding])
        batch.lora = self.executor.lora_context(slots)
        return batch, slots

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
        finished = self.table.named_finished(plan)
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


def _load(cfg: WorkerConfig, dtype: torch.dtype, device: torch.device,
          tp: TensorParallel | None) -> CausalLM:
    """The model; under tensor parallelism (`tp`) this rank's shard, joined to the others'."""
    t0 = time.monotonic()
    model = load_model(cfg.model, dtype, device, cfg.onednn,
                       shard=tp.shard if tp is not None else None, load_format=cfg.load_format)
    if tp is not None:
        tp.install(model)
    log.info("model loaded in %.2f s (%s, %s, %s)", time.monotonic() - t0,
             model.config.architecture, dtype, device)
    return model


def _vision(cfg: WorkerConfig, spec: VisionSpec, dtype: torch.dtype, device: torch.device
            ) -> VisionInputs:
    """A VL checkpoint's vision tower and M-RoPE inputs (`gpu_worker.vision`)."""
    tower = VisionTower(cfg.model, spec, dtype, device)
    log.info("vision tower: %s, %.1f MiB", spec.architecture,
             sum(p.nbytes for p in tower.model.parameters()) / 2**20)
    return VisionInputs(tower, device)


def _host_pool(cfg: WorkerConfig, caches: list[tuple[torch.Tensor, torch.Tensor]],
               proposer: object, device: torch.device) -> HostKvPool | None:
    if cfg.kv_offloading_gib <= 0:
        return None
    draft = getattr(proposer, "caches", [])  # a draft model's cache mirrors our block ids
    return HostKvPool([t for kv in (*caches, *draft) for t in kv], cfg.kv_offloading_gib,
                      device)


def _check_hybrid(cfg: WorkerConfig, hybrid: str | None, tp_size: int) -> None:
    """What a hybrid model cannot be served with yet: a start-up error, never wrong tokens."""
    if hybrid is None:
        return
    if cfg.speculative and cfg.speculative.method != "ngram":
        raise ValueError(f"speculative method {cfg.speculative.method!r} is not supported for "
                         f"{hybrid}: only 'ngram' (a draft model would need states of its own)")
    if cfg.adapter_cache and cfg.max_loras > 0 and tp_size > 1:
        raise ValueError(f"LoRA adapters under tensor parallelism are not supported for "
                         f"{hybrid} yet (--adapter-cache with --tensor-parallel-size)")
    if cfg.kv_offloading_gib > 0:
        raise ValueError(f"--kv-offloading-size is not supported for {hybrid}: the host tier "
                         "keeps KV blocks, not the recurrent-state checkpoints a hit restores")


def _adapters(cfg: WorkerConfig, model: CausalLM, dtype: torch.dtype, device: torch.device,
              tp: TensorParallel | None) -> LoraWeights | None:
    """LoRA adapter slots (`gpu_worker.lora`); None: adapters off, every row is the base."""
    if not (cfg.adapter_cache and cfg.max_loras > 0):
        return None
    whole = load_model_args(cfg.model)  # model.config is this rank's part under TP
    tp_split = (tensor_parallel_split(whole, tp.shard)
                if tp is not None and tp.shard.size > 1 else None)
    lora = LoraWeights(ModelShapes.of(model.config), cfg.adapter_cache, cfg.max_loras,
                       cfg.max_lora_rank, dtype, device, tp_split, ModelShapes.of(whole),
                       model.config.moe_layers)
    mc = model.config
    if mc.is_hybrid:
        lora.hybrid(mc.num_heads, mc.head_dim,
                    tuple(mc.is_linear(n) for n in range(mc.num_layers)))
    log.info("LoRA: %d adapter slots of rank <= %d (%.1f MiB)", cfg.max_loras,
             cfg.max_lora_rank, lora.nbytes / 2**20)
    return lora


def _columns(per_step: list[torch.Tensor]) -> np.ndarray:
    """Per-step [B] or [B, 1 + k] tensors as one host array [tokens in order, B]."""
    return torch.cat([t.reshape(t.shape[0], -1).T for t in per_step]).cpu().numpy()
