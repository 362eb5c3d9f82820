"""M-RoPE position ids (Qwen VL): three axes, temporal, height and width.

As transformers' `get_rope_index` for images: text tokens count up on all three axes; an
image's placeholders take the current position plus their cell's (t, h, w) in the merged grid;
after an image the count resumes at its start plus the larger side of its grid. Past the
prompt every axis is the token's index plus the request's `delta` (the prompt's largest
position + 1 - its length), which is what transformers adds to the cache position while it
decodes.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem_serve.proto.request_params import ImageInput


def mrope_positions(num_tokens: int, images: Sequence[ImageInput], merge: int
                    ) -> tuple[np.ndarray, int]:
    """(positions [3, num_tokens] int64 of a prompt, the delta of the tokens after it)."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    current = at = 0
    for im in sorted(images, key=lambda x: x.offset):
        pos[:, at:im.offset] = current + np.arange(im.offset - at)
        current += im.offset - at
        t, h, w = (int(x) for x in im.grid_thw)
        gh, gw = h // merge, w // merge
        if t * gh * gw != im.length:
            raise ValueError(f"image at {im.offset}: grid {t}x{h}x{w} merged by {merge} is "
                             f"{t * gh * gw} tokens, the prompt has {im.length}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        end = im.offset + im.length
        for axis, grid in enumerate((tt, hh, ww)):
            pos[axis, im.offset:end] = grid.ravel() + current
        current += max(gh, gw)
        at = end
    pos[:, at:] = current + np.arange(num_tokens - at)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


def history_positions(prompt: np.ndarray, delta: int, start: int, end: int) -> np.ndarray:
    """Positions [3, end - start] of history tokens [start, end): the prompt's own, then the
    index plus `delta` on every axis."""
    n = prompt.shape[1]
    inside = prompt[:, start:min(end, n)]
    if end <= n:
        return inside
    after = np.arange(max(start, n), end) + delta
    return np.concatenate([inside, np.broadcast_to(after, (3, after.shape[0]))], axis=1)
