"""The recurrent-state cache of a hybrid model: fixed per-request slots holding, for every
Gated DeltaNet layer, the convolution's last K - 1 inputs and the delta rule's matrix state.

Unlike KV, a state does not grow with the sequence: a request holds one slot from the plan
that adds (or resumes) it until the plan that drops (or preempts) it, whatever its length.
The scheduler never runs more than `--max-num-seqs` requests, so that many slots (plus one
scratch slot that masked decode rows read and write, as masked rows write the KV cache's
scratch block) are allocated with the KV cache, and their bytes come out of its budget.
Slots are handed out on the gpu worker (`SlotPool`, from the request table), since which
slot a request holds concerns only the device.

The matrix state is kept in float32 whatever the model dtype (it accumulates over the whole
sequence; transformers and flash-linear-attention keep it in float32 too); the convolution's
inputs in the model dtype, as transformers does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.models.config import ModelArgs


def bytes_per_slot(args: ModelArgs, dtype: torch.dtype) -> int:
    """One request's state across the linear layers."""
    s = args.linear_attn
    if s is None:
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    conv = s.conv_dim * (s.conv_kernel - 1) * elem
    recurrent = s.num_v_heads * s.head_k_dim * s.head_v_dim * 4
    return (args.num_layers - args.num_attention_layers) * (conv + recurrent)


class StateCache:
    """Per linear layer: conv [slots + 1, C, K - 1] and recurrent [slots + 1, Hv, dk, dv]."""

    def __init__(self, args: ModelArgs, num_slots: int, dtype: torch.dtype,
                 device: torch.device, checkpoints: int = 0, block_size: int = 16) -> None:
        """`checkpoints`: prefix caching's KV blocks (0: off): one state checkpoint per block
        (plus a scratch one), written every `span` tokens (`checkpoint_span`)."""
        s = args.linear_attn
        assert s is not None, "a hybrid model's state cache"
        self.num_slots = num_slots
        self.scratch = num_slots  # the last slot: masked decode rows'
        layers = args.num_layers - args.num_attention_layers
        self.conv = [torch.zeros(num_slots + 1, s.conv_dim, s.conv_kernel - 1, dtype=dtype,
                                 device=device) for _ in range(layers)]
        self.recurrent = [torch.zeros(num_slots + 1, s.num_v_heads, s.head_k_dim, s.head_v_dim,
                                      dtype=torch.float32, device=device)
                          for _ in range(layers)]
        self.block_size = block_size
        self.span = checkpoint_span(block_size) if checkpoints else 0
        self.ckpt_scratch = checkpoints
        self.ckpt_conv = [torch.zeros(checkpoints + 1, *t.shape[1:], dtype=t.dtype, device=device)
                          for t in self.conv] if checkpoints else []
        self.ckpt_recurrent = [torch.zeros(checkpoints + 1, *t.shape[1:], dtype=t.dtype,
                                           device=device)
                               for t in self.recurrent] if checkpoints else []
        # A verify step's states per row and position, per layer, until `commit` keeps each
        # row's: (slots [B], conv [B, 2 + k, ...], recurrent [B, 2 + k, ...]).
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = \
            [None] * layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.conv, *self.recurrent, *self.ckpt_conv,
                                      *self.ckpt_recurrent))

    def rows(self, meta: AttentionMetadata) -> StateRowsPlan:
        """Which slot each of a forward's rows reads and writes (once per forward, shared by
        every linear layer); no host read."""
        states = meta.states
        if states is None:
            raise ValueError("a hybrid model's forward needs its rows' state slots")
        n = meta.slot_mapping.shape[0] if meta.is_decode else meta.num_decode
        decode = ckpt = None
        if n:
            assert states.decode is not None, "decode rows without state slots"
            base = states.decode.shape[0]  # a verify step's draft rows come after these
            # Masked rows (slot -1: finished, or joining later) use the scratch slot.
            decode = torch.where(meta.slot_mapping[:base] >= 0, states.decode, self.scratch)
            if self.span:  # a decode token that ends a span: its state into its block's
                slots = meta.slot_mapping[:base]
                ends = (slots >= 0) & (meta.seq_lens[:base] % self.span == 0)
                ckpt = torch.where(ends, slots // self.block_size, self.ckpt_scratch)
        lens = (meta.query_lens or [])[n:] if not meta.is_decode else []
        starts, at = [], n
        for length in lens:
            starts.append(at)
            at += length
        pieces = [Segments(slot, fresh, start, length, marks) for
                  slot, fresh, start, length, marks in zip(
                      states.prefill, states.fresh, starts, lens,
                      states.marks or [[]] * len(lens), strict=True)]
        return StateRowsPlan(n, decode, pieces, states.verify, ckpt)

    def restore(self, slot: int, block: int) -> None:
        """A request added with a cached prefix: the state checkpointed at the prefix's last
        block into its slot (before any piece or decode step of it reads the slot)."""
        for layer in range(len(self.conv)):
            self.conv[layer][slot] = self.ckpt_conv[layer][block]
            self.recurrent[layer][slot] = self.ckpt_recurrent[layer][block]

    def commit(self, count: torch.Tensor) -> None:
        """After a verify step: each row's state after its `count` [B] emitted tokens (0:
        the state before the step), from every linear layer's pending states."""
        for layer, pending in enumerate(self.pending):
            assert pending is not None, "a verify step's states to commit"
            slots, conv, recurrent = pending
            rows = torch.arange(slots.shape[0], device=slots.device)
            self.conv[layer].index_copy_(0, slots, conv[rows, count])
            self.recurrent[layer].index_copy_(0, slots, recurrent[rows, count])
            self.pending[layer] = None


@dataclass
class StateRowsPlan:
    """A forward's rows as the linear layers see them: `num_decode` decode rows first (their
    slots on the device), then prefill pieces (slot, fresh, first token, token count)."""

    num_decode: int
    decode_slots: torch.Tensor | None
    pieces: list[Segments]
    verify: tuple[torch.Tensor, int] | None = None  # speculating rows [S], k
    # Prefix caching: the checkpoint each decode row's state goes to (scratch: none).
    decode_checkpoints: torch.Tensor | None = None


@dataclass
class Segments:
    """A prefill piece as a linear layer runs it: its slot, whether its state starts from
    zeros (`fresh`) or the slot's, its tokens in the forward, and where it checkpoints its
    state ((offset in the piece, block))."""

    slot: int
    fresh: bool
    start: int
    length: int
    marks: list[tuple[int, int]]

    def parts(self) -> list[tuple[int, int, int]]:
        """(first token, last token + 1, the block to checkpoint after it or -1)."""
        out, at = [], 0
        for offset, block in self.marks:
            out.append((self.start + at, self.start + offset, block))
            at = offset
        if at < self.length:
            out.append((self.start + at, self.start + self.length, -1))
        return out


def checkpoint_span(block_size: int) -> int:
    """Tokens between state checkpoints: whole blocks and whole chunks of the delta rule
    (64), so a prompt's chunks fall where a prefill from its start puts them."""
    return block_size * 64 // math.gcd(block_size, 64)

class SlotPool:
    """The free state slots (host); a request takes one when added or resumed."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free recurrent-state slot: more requests than "
                               "--max-num-seqs are running")
        return self._free.pop()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def give(self, slot: int) -> None:
        if slot >= 0:
            self._free.append(slot)
