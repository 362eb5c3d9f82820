"""Gemma 3's images attend both ways among their tokens, so the scheduler never ends a prefill
piece or a prefix hit inside one: a piece is cut back to the image's start, or, starting at
it, stretched over the whole image even past the step's budget; a hit is rounded down to
the image's start."""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import ImageInput, SamplingParams
from tandem_serve.scheduler.budget import StepBudget, whole_piece
from tandem_serve.scheduler.core import Scheduler
from tandem_serve.scheduler.requests import Request
from tests.scheduler.sched_utils import params, step_done


def _image(offset: int, length: int, digest: bytes = b"a" * 16) -> ImageInput:
    return ImageInput(offset, length, digest, np.zeros((1, 1), np.float32), [1, 4, 4],
                      bidirectional=True)


def _add(sched: Scheduler, rid: int, ids: list[int], images: list[ImageInput]) -> None:
    msg = AddRequest(rid, np.array(ids, dtype=np.int32), SamplingParams(max_new_tokens=4),
                     0.0, images=images)
    assert sched.add_request(msg) is None


def test_whole_piece_cuts_back_or_stretches_over_the_image() -> None:
    spans = [(10, 26)]
    assert whole_piece(0, 8, 40, spans) == 8  # ends before the image
    assert whole_piece(0, 12, 40, spans) == 10  # inside: back to its start
    assert whole_piece(10, 4, 40, spans) == 16  # starts at it: the whole image
    assert whole_piece(10, 4, 12, spans) == 0  # ... unless that is more than allowed
    assert whole_piece(0, 26, 40, spans) == 26  # ends right after it
    assert whole_piece(0, 0, 40, spans) == 0


def test_split_never_ends_a_piece_inside_an_image() -> None:
    budget = StepBudget(num_steps=4, tokens=6)
    split = budget.split(40, lambda first: 4, context=0, whole=[(10, 26), (30, 34)])
    assert split is not None
    ends = np.cumsum(split.pieces)
    assert not any(a < e < b for e in ends for a, b in [(10, 26), (30, 34)]), split.pieces
    assert split.pieces == [6, 4, 16, 4]  # the image's step runs over the budget of 6


def test_a_prompt_ending_with_an_image_and_one_token_completes_in_its_piece() -> None:
    budget = StepBudget(num_steps=2, tokens=4)
    split = budget.split(20, lambda first: 2, context=4, whole=[(4, 24)])
    assert split is not None and split.pieces == [20] and split.join == 0


def test_prefix_hits_end_at_an_image_start() -> None:
    req = Request(1, np.arange(40, dtype=np.int32), SamplingParams(), 0.0, 64,
                  images=[_image(5, 6), _image(13, 16)])
    assert req.whole_spans == [(5, 11), (13, 29)]
    assert req.cached_blocks(2, 4) == 1  # 8 is inside [5, 11): back to block 1 (4)
    assert req.cached_blocks(4, 4) == 3  # 16 is inside [13, 29): back to 12
    assert req.cached_blocks(8, 4) == 8  # past both
    # A cut that lands inside an earlier image is cut again.
    req = Request(1, np.arange(40, dtype=np.int32), SamplingParams(), 0.0, 64,
                  images=[_image(2, 7), _image(10, 20)])
    assert req.cached_blocks(4, 4) == 0  # 16 -> 8 (inside [2, 9)) -> 0
    plain = Request(1, np.arange(40, dtype=np.int32), SamplingParams(), 0.0, 64,
                    images=[ImageInput(5, 6, b"b" * 16, np.zeros((1, 1), np.float32),
                                       [1, 2, 12])])
    assert plain.whole_spans == [] and plain.cached_blocks(2, 4) == 2  # Qwen: may cut


def test_plans_and_a_prefix_hit_keep_images_whole() -> None:
    # Nothing decodes: a plan's first step takes up to 4 x 6 = 24 tokens.
    sched = Scheduler(params(num_steps=4, max_num_batched_tokens=6, max_model_len=128))
    ids = list(range(100, 150))  # 50 tokens: text, a 30-token image at [9, 39), text
    image = [_image(9, 30)]
    _add(sched, 1, ids, image)
    done, ends = 0, []
    while done < len(ids) - 1:
        plan = sched.build_plan()
        pieces = [m.prefill_steps or [m.num_prefill_tokens]
                  for m in [*plan.new, *plan.cont] if m.num_prefill_tokens]
        for n in (x for p in pieces for x in p if x):
            done += n
            ends.append(done)
        sched.on_step_done(step_done(plan.plan_id))
    # Cut back to the image's start, then the image whole (30 tokens past a budget of 24).
    assert ends == [9, 39, 49]
    # Its first 7 blocks again, then other text: a hit of 28 tokens would end inside the
    # image, so it ends at 8, the last block boundary before it.
    _add(sched, 2, ids[:30] + [7] * 20, image)
    plan = sched.build_plan()
    assert {n.request_id: n.num_cached_tokens for n in plan.new} == {2: 8}
    sched.check_invariants()
