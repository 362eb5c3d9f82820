"""Piecewise CUDA graphs for mixed forwards: everything but attention replayed from graphs.

A mixed step (decode rows plus a step's prefill pieces, `StepExecutor.forward_mixed`) has a
token count and attention layout that change every step, so it cannot be one graph the way
a decode step is (`gpu_worker.graphs.decode`).  Eager, a 7-8B model's 32 layers launch about
a thousand kernels, which costs the host tens of milliseconds: on an H200 with the
Llama-3-8B shape, the arrival workload's steps that carried prefill pieces took ~31 ms (ITL
p50) where decode graph replays took ~10, and the stall scenario's p99 gap at a 512-token
budget was 40 ms against a 6.5 ms median.  vLLM's answer, taken here: cut the forward at
attention.  Each layer's part before attention (norm, qkv, RoPE) and after it (o,
residual, norms, MLP) is row-wise, so for a token count padded up to a bucket it can be
captured once (every bucket at start-up); attention (the KV write and the model's attention
backend: FlexAttention, the split SDPA path or flash_attn) runs eagerly between the replays
on the real rows, with the step's own plan.  A
forward is then L + 1 replays and L attention calls; with them the same stall scenario's
p99 gap was 20 ms.

Static buffers, shared by every bucket (sliced to it): the input ids and positions, the
residual stream `x`, the RoPE'd q|k and v, attention's output, and each RoPE's cos/sin.
Piece 0 embeds and projects layer 0; piece i (1..L-1) finishes layer i-1 and projects layer
i; piece L finishes the last layer and applies the final norm.  Rows past the real count
compute garbage that no real row reads (every captured op is row-wise) and attention never
sees them.

Left eager (the caller's plain forward): LoRA rows (their slot mixing is per plan),
LongRoPE models (cos/sin depend on each row's history), tensor parallelism (a capture that
fails on one rank only would desynchronise the collectives), token counts above the largest
bucket, and everything after a failed capture.  On the CPU the same pieces run as plain
calls (`capture=False`): the tests check the cut, the graphs are checked on a GPU.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import KVCache

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.lora import LoraContext
    from tandem_serve.gpu_worker.models.decoder import CausalLM, DecoderLayer

log = logging.getLogger(__name__)

# Mixed steps of up to this many prefill tokens (plus every decode row) use the graphs.
MIXED_GRAPH_TOKENS = 2048


def mixed_forward(pieces: MixedGraphs | None, model: CausalLM, ids: torch.Tensor,
                  positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata,
                  lora: LoraContext | None, history: torch.Tensor | None,
                  mm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A mixed forward's hidden states: from the pieces where they serve it, else eager
    (always with image embeddings `mm`: the pieces embed token ids only)."""
    if pieces is not None and lora is None and history is None and mm is None \
            and positions.dim() == 1 and pieces.usable(len(ids)):
        hidden = pieces.forward(ids, positions, kv_caches, meta)
        if hidden is not None:
            return hidden
    return cast(torch.Tensor, model(ids, positions, kv_caches, meta, lora, history, mm))


def token_buckets(max_tokens: int) -> list[int]:
    """16 .. 256 by powers of two, then multiples of 128, up to `max_tokens`: padding
    costs at most 2x where a step is launch-bound and at most 128 rows above that."""
    out = [b for b in (16, 32, 64, 128, 256) if b < max_tokens]
    out += list(range(384, max_tokens, 128))
    return out + [max_tokens]


class MixedGraphs:
    def __init__(self, model: CausalLM, max_tokens: int, capture: bool) -> None:
        """`capture`: CUDA graphs of every bucket now (else plain calls)."""
        self.model = model
        self.layers = [cast("DecoderLayer", m) for m in model.layers]
        self.capture = capture
        self.buckets = token_buckets(max_tokens)
        self.enabled = True
        a, dev, dt = model.config, model.device, model.dtype
        n, hq, hkv, d = self.buckets[-1], a.num_heads, a.num_kv_heads, a.head_dim
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.x = torch.zeros(n, a.hidden_size, dtype=dt, device=dev)
        self.qk = torch.zeros(n, hq + hkv, d, dtype=dt, device=dev)
        self.v = torch.zeros(n, hkv, d, dtype=dt, device=dev)
        self.attn = torch.zeros(n, hq * d, dtype=dt, device=dev)
        # Each RoPE's cos/sin [n, 1, rotary_dim], written by piece 0.
        self.cos_sin = [tuple(torch.zeros(n, *c.shape[1:], dtype=c.dtype, device=dev)
                              for c in r.cos_sin(self.pos[:1], dt)) for r in model.ropes]
        self.graphs: dict[int, list[Callable[[], None]]] = {}  # bucket -> L + 1 pieces
        self._pool: Any = None
        if capture:
            self.capture_all()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket's pieces now, at start-up, as vLLM does: a bucket captured on first
        use stalls that step by its L + 1 captures, and an arrival workload meets its token
        counts one by one mid-serving (on an H200, with first-use capture, the mixed arm's
        ITL p99 was 137 ms where eager mixed steps had 57)."""
        t0 = time.monotonic()
        for bucket in self.buckets:
            if self._pieces(bucket) is None:
                return
        log.info("captured mixed-step graphs for %d token counts in %.1f s",
                 len(self.buckets), time.monotonic() - t0)

    def usable(self, num_tokens: int) -> bool:
        return self.enabled and num_tokens <= self.buckets[-1]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The model's final-normed hidden states [T, hidden], or None where the pieces
        cannot serve (the caller runs its eager forward)."""
        t = int(ids.shape[0])
        bucket = next(b for b in self.buckets if b >= t)
        self.ids[:t].copy_(ids)
        self.pos[:t].copy_(positions)
        self.ids[t:bucket].zero_()
        self.pos[t:bucket].zero_()
        pieces = self.graphs.get(bucket)
        if pieces is None:
            pieces = self._pieces(bucket)
            if pieces is None:
                return None
        attention = self.model.attention
        plan = attention.prepare(meta, kv_caches[0], self.model._windows)
        hq = self.model.config.num_heads
        for i, piece in enumerate(pieces):
            piece()  # a graph's replay, or the plain call on the CPU
            if i == len(self.layers):
                break
            layer = self.layers[i]
            a = layer.attend(self.qk[:t, :hq], self.qk[:t, hq:], self.v[:t], kv_caches[i],
                             attention, plan)
            self.attn[:t].copy_(a.reshape(t, -1))
        return self.x[:t].clone()

    def _pieces(self, bucket: int) -> list[Callable[[], None]] | None:
        fns = self._functions(bucket)
        if not self.capture:
            self.graphs[bucket] = fns
            return fns
        try:
            graphs = [self._record(fn).replay for fn in fns]
        except Exception:  # noqa: BLE001 - any capture failure: mixed steps run eagerly
            log.exception("piecewise CUDA graph capture failed (%d tokens); mixed steps run "
                          "eagerly", bucket)
            self.enabled = False
            return None
        self.graphs[bucket] = graphs
        log.debug("captured mixed-step graphs: %d tokens, %d pieces", bucket, len(graphs))
        return graphs

    def _functions(self, n: int) -> list[Callable[[], None]]:
        """Piece 0, the L - 1 pieces between attention calls, and the last, over n rows."""
        m, layers = self.model, self.layers
        ids, pos, x, qk, v, attn = (self.ids[:n], self.pos[:n], self.x[:n], self.qk[:n],
                                    self.v[:n], self.attn[:n])
        hq = m.config.num_heads

        def project(layer: DecoderLayer, h: torch.Tensor) -> None:
            q, k, val = layer.project_qkv(h, self._rope(layer, n), None)
            qk[:, :hq].copy_(q)
            qk[:, hq:].copy_(k)
            v.copy_(val)

        def first() -> None:
            for r, (cos, sin) in zip(m.ropes, self.cos_sin, strict=True):
                c, s = r.cos_sin(pos, m.dtype)
                cos[:n].copy_(c)
                sin[:n].copy_(s)
            e = m.embed(ids)
            x.copy_(e * m.embed_scale if m.embed_scale is not None else e)
            project(layers[0], layers[0].norm(x, layers[0].input_norm, layers[0].eps))

        def between(i: int) -> Callable[[], None]:
            def run() -> None:
                x.copy_(layers[i - 1].after_attention(x, attn, None))
                project(layers[i], layers[i].norm(x, layers[i].input_norm, layers[i].eps))
            return run

        def last() -> None:
            x.copy_(m.norm_fn(layers[-1].after_attention(x, attn, None), m.norm,
                              m.config.rms_norm_eps))

        return [first, *(between(i) for i in range(1, len(layers))), last]

    def _rope(self, layer: DecoderLayer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[layer.rope_index]
        return cos[:n], sin[:n]

    def _record(self, fn: Callable[[], None]) -> Any:
        from tandem_serve.gpu_worker.graphs.decode import record  # CUDA only: imported here

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record(fn, self._pool)[0]
