"""What a VL model's forwards need beyond token ids: image embeddings in place of the
placeholder tokens, and M-RoPE positions.

A prefill piece covering placeholders takes those rows of its images' embeddings (the tower
runs once per forward for the images not cached, `tower`), whatever part of an image the
piece holds: a chunked prompt or a prefix-cache hit may cut a Qwen image anywhere. A piece's
positions are the prompt's M-RoPE ids ([3, P]); a decode row's are its position plus its
request's delta, the same on every axis, which the rope computes from a [B] tensor as it is.
Gemma 3 has plain positions, and its images' tokens attend to each other both ways: each
piece says where its images are (`PrefillInputs.bidirectional`), and holds them whole.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.gpu_worker.steps import Piece, PrefillInputs
from tandem_serve.gpu_worker.vision.positions import history_positions, mrope_positions
from tandem_serve.gpu_worker.vision.tower import VisionTower
from tandem_serve.ipc.tracing import TRACER


def whole_images(p: Piece) -> list[tuple[int, int]]:
    """The [start, end) positions of the images a piece holds; each must be whole, since its
    tokens attend to each other both ways (the scheduler never cuts one: a cut image's first
    part would have been computed without seeing the rest)."""
    end, out = p.start + p.count, []
    for im in p.req.images:
        lo, hi = im.offset, im.offset + im.length
        if lo < end and p.start < hi:
            if lo < p.start or hi > end:
                raise ValueError(f"request {p.req.request_id}: prefill piece [{p.start}, "
                                 f"{end}) cuts the image at [{lo}, {hi}), whose tokens "
                                 "attend to each other both ways")
            out.append((lo, hi))
    return out


class VisionInputs:
    """Image embeddings and M-RoPE positions of a VL model's forwards."""

    def __init__(self, tower: VisionTower, device: torch.device) -> None:
        self.tower = tower
        self.merge = tower.spec.spatial_merge_size
        self.mrope = bool(tower.spec.mrope_section)
        self.device = device

    def positions_of(self, req: RequestState) -> tuple[np.ndarray, int]:
        """The request's prompt positions [3, prompt] and delta, computed once."""
        if req.mrope is None:
            req.mrope, req.rope_delta = mrope_positions(req.num_prompt, req.images, self.merge)
        return req.mrope, req.rope_delta

    def attach(self, inp: PrefillInputs, pieces: Sequence[Piece]) -> None:
        """Set `inp`'s M-RoPE positions and the embeddings of its placeholder tokens."""
        if self.mrope:
            cols = [history_positions(*self.positions_of(p.req), p.start, p.start + p.count)
                    for p in pieces]
            inp.positions = torch.as_tensor(np.concatenate(cols, axis=1)).to(self.device)
        if self.tower.spec.bidirectional:
            spans = [whole_images(p) for p in pieces]
            inp.bidirectional = spans if any(spans) else None  # None: causal, fast paths
        needed, rows, at = [], [], 0
        for p in pieces:
            end = p.start + p.count
            for im in p.req.images:
                lo, hi = max(p.start, im.offset), min(end, im.offset + im.length)
                if lo < hi:
                    needed.append(im)
                    rows.append((at + lo - p.start, lo - im.offset, hi - lo))
            at += p.count
        if not needed:
            return
        with TRACER.span("encode"):  # the profiler's encoder share of a step
            embs = self.tower.embeddings(needed)
        index = np.concatenate([np.arange(t, t + n) for t, _, n in rows])
        values = torch.cat([e[:, first:first + n] for e, (_, first, n) in zip(embs, rows,
                                                                             strict=True)],
                           dim=1)
        inp.mm = (torch.as_tensor(index).to(self.device), values)

    def deltas(self, decoding: Sequence[RequestState]) -> torch.Tensor | None:
        """Each decode row's M-RoPE delta [B] (None: not an M-RoPE model)."""
        if not self.mrope:
            return None
        return torch.tensor([self.positions_of(r)[1] for r in decoding],
                            dtype=torch.int64).to(self.device)
