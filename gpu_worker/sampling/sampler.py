"""Batched on-device sampler for the multi-step decode loop.

Each step's sampled ids feed the next step on the device, so nothing here reads a device value
back to the host: per-row parameters are tensors, every row is processed by the same vectorised
ops, and only host facts known before the plan (``all_greedy``, ``max_top_n``, the
:class:`SamplerHints` flags) steer Python control flow. ``forbid_host_sync()`` in
``tests.gpu_worker.sync_guard`` enforces this in the tests.

Processing follows Hugging Face ``generate()`` (its LogitsProcessors are the reference):

0. OpenAI's ``logit_bias``: a sparse per-row bias added to the raw logits (HF's
   ``SequenceBiasLogitsProcessor`` on single tokens, which also runs first; vLLM's order),
1. repetition penalty (``RepetitionPenaltyLogitsProcessor``) over prompt + output tokens,
   then OpenAI's frequency and presence penalties over output tokens (HF has none; the
   formula is OpenAI's and vLLM's: ``logit -= frequency * count + presence * (count > 0)``),
2. ``min_new_tokens``: stop ids get -inf while ``output_count < min_new_tokens``
   (``MinNewTokensLengthLogitsProcessor``, extended to the request's stop ids),
3. exponential-decay length penalty on the stop-id columns (``ExponentialDecayLengthPenalty``),
4. guided decoding (``mask``): forbidden tokens get -inf, as HF applies a custom
   LogitsProcessor after its own processors and before the warpers;
5. greedy rows (temperature 0) take the argmax here;
6. sampled rows: temperature, top-k, top-p, min-p, typical-p (HF's warper order in
   ``_get_logits_processor``), then a seeded draw from what is left.

Truncation never sorts the vocabulary: a full sort of [32, 32000] costs ~80 ms on one CPU
core. Each cut is instead an exact per-row threshold found by a three-pass radix select over
the float32 bits of p / p_max (non-negative floats order like their bit patterns), weighted
by token counts (top-k) or by fixed-point probability mass (top-p, typical-p). Integer sums
are exact and order-independent, so the kept set of a row never depends on the rest of the
batch, on the device's reduction order, or on which code path the batch took (except
typical-p, whose entropy is a float reduction over the row's domain: the top ``max_top_k``
and the whole vocabulary may round it differently).

The draw is an inverse-CDF lookup over the same fixed-point weights, in token-id order, with
one uniform per row from a SplitMix64 hash of (seed, output_count) computed with int64 tensor
ops. Same seed and step give the same token; steps draw independently. A Gumbel-max race
(a hashed uniform per token) gives the same guarantees but needs a 12-op int64 hash, two logs
and an argmin over all [B, V] entries each step: about twice the cost of this draw on CPU,
where the exp and the integer weights are shared with top-p / min-p anyway.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from tandem_serve.gpu_worker.sampling.seeding import row_keys, row_uniform

__all__ = ["RowParams", "Sampler", "SamplerHints", "SamplerOutput", "SamplingBatch",
           "SamplingTensors", "row_keys", "row_uniform"]

# Guided decoding's step 4: sets the tokens its rows forbid to -inf, in place.
LogitsMask = Callable[[Tensor], None]


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, one row per request slot, all on the device."""

    temperature: Tensor  # [B] f32, 0 = greedy
    top_k: Tensor  # [B] int32, 0 = off
    top_p: Tensor  # [B] f32, 1.0 = off
    typical_p: Tensor  # [B] f32, 1.0 = off (applies when 0 < typical_p < 1)
    min_p: Tensor  # [B] f32, 0 = off
    repetition_penalty: Tensor  # [B] f32, 1.0 = off (HF semantics over prompt + output)
    seed: Tensor  # [B] int64, every row has one
    min_new_tokens: Tensor  # [B] int32: stop ids are masked while output_count < this
    stop_token_ids: Tensor  # [B, S] int64 padded with -1 (EOS ids + request stop ids)
    lp_start: Tensor  # [B] int32 exponential-decay length penalty start (generated tokens)
    lp_decay: Tensor  # [B] f32, 1.0 = off (decay_factor)
    # [B] int32. Not read by the sampler: HF's penalty index is
    # cur_len - (start + prompt_len) = output_count - start, and output_count already counts
    # generated tokens from the request's start (also across preemption and re-prefill).
    prompt_len: Tensor
    # [B] f32 OpenAI penalties over output tokens, 0 = off; None when no row of the batch uses
    # them (the sampler then needs no per-row token counts).
    frequency_penalty: Tensor | None = None
    presence_penalty: Tensor | None = None
    # [B, L] int64 token ids and [B, L] f32 biases (OpenAI's logit_bias), padded with id 0 and
    # bias 0.0; None when no row of the batch has one.
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] f32 logprob of the chosen token
    ranks: Tensor | None  # [B] int32, 1 = most likely
    top_ids: Tensor | None  # [B, n] int64 top-n alternatives, sorted by logprob descending
    top_logprobs: Tensor | None  # [B, n] f32


@dataclass(frozen=True)
class SamplerHints:
    """Host facts known before the plan that let the sampler skip work.

    The defaults are always correct; a False flag promises that no sampled row
    (temperature > 0) uses that feature, and the sampler then skips it for every row.
    ``max_top_k > 0`` promises that every sampled row has ``1 <= top_k <= max_top_k``; the
    sampler then only looks at each row's ``max_top_k`` largest logits, which makes top-p,
    typical-p, min-p and the random draw cost O(B * max_top_k) instead of O(B * V).
    """

    any_greedy: bool = True  # some row has temperature 0 (ignored when all_greedy)
    any_top_k: bool = True
    any_top_p: bool = True
    any_min_p: bool = True
    any_typical: bool = True
    max_top_k: int = 0
    any_min_new_tokens: bool = True  # also covers greedy rows
    any_length_penalty: bool = True  # also covers greedy rows

    @classmethod
    def for_rows(cls, temperature: Sequence[float], top_k: Sequence[int],
                 top_p: Sequence[float], typical_p: Sequence[float], min_p: Sequence[float],
                 min_new_tokens: Sequence[int], lp_decay: Sequence[float]) -> SamplerHints:
        """The tightest hints for a batch, from the host copies of its per-row parameters."""
        sampled = [i for i, t in enumerate(temperature) if t > 0]
        ks = [top_k[i] for i in sampled]
        return cls(
            any_greedy=len(sampled) < len(temperature),
            any_top_k=any(k > 0 for k in ks),
            any_top_p=any(top_p[i] < 1.0 for i in sampled),
            any_min_p=any(min_p[i] > 0.0 for i in sampled),
            any_typical=any(0.0 < typical_p[i] < 1.0 for i in sampled),
            max_top_k=max(ks) if ks and all(k > 0 for k in ks) else 0,
            any_min_new_tokens=any(m > 0 for m in min_new_tokens),
            any_length_penalty=any(d != 1.0 for d in lp_decay),
        )


    @classmethod
    def from_params(cls, params: Sequence[RowParams]) -> SamplerHints:
        """``for_rows`` from per-row parameter objects (``proto.request_params.SamplingParams``,
        say)."""
        return cls.for_rows([p.temperature for p in params], [p.top_k for p in params],
                            [p.top_p for p in params], [p.typical_p for p in params],
                            [p.min_p for p in params], [p.min_new_tokens for p in params],
                            [p.length_penalty_decay for p in params])


class RowParams(Protocol):
    """The host-side fields of one row's sampling parameters that the hints read."""

    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    min_p: float
    min_new_tokens: int
    length_penalty_decay: float


_DEFAULT_HINTS = SamplerHints()


@dataclass
class SamplingBatch:
    """What the sampler reads of a batch besides its logits and output counts: the rows'
    parameters on the device, their token tables, and the host facts known before the plan
    that steer its control flow (no device value ever does)."""

    params: SamplingTensors
    hints: SamplerHints = field(default_factory=SamplerHints)
    seen: Tensor | None = None  # [B, V] bool, prompt + output tokens (repetition penalty)
    # [B, V] f32 output-token counts when some row has a frequency or presence penalty.
    counts: Tensor | None = None
    all_greedy: bool = False
    any_penalty: bool = False  # some row has a repetition penalty: `seen` is set
    need_logprobs: bool = False
    max_top_n: int = 0

# Probability mass is summed as int64 fixed point: exact and order-independent. A token's
# weight is at most 2**40, so even a 2**22-token vocabulary stays below 2**63.
_MASS_ONE = float(1 << 40)

# Radix-select digits over 31-bit keys, most significant first: (shift, width).
_RADIX_PASSES = ((21, 10), (10, 11), (0, 10))
# Up to this many candidates per row a sort beats the radix select's histograms.
_SORT_MAX_WIDTH = 512


def mass_weights(xs: Tensor) -> tuple[Tensor, Tensor]:
    """(e, w): e = exp(x - row max) = p / p_max in f32, w = ceil(e * 2**40) as int64.

    Neither needs a normalising sum, so a token's numbers do not depend on what else shares
    its row's domain. The ceiling gives every token of nonzero probability a weight >= 1 (so
    it stays reachable, as in HF) and -inf logits exactly 0.
    """
    e = (xs - xs.amax(dim=1, keepdim=True)).exp_()
    return e, (e * _MASS_ONE).ceil_().to(torch.int64)


def _threshold(keys: Tensor, weights: Tensor, target: Tensor) -> Tensor:
    """Per row, the largest threshold t with sum(weights[keys >= t]) >= target.

    keys: [B, W] int32 in [0, 2**31); weights: [B, W] int64 >= 0 (may be an expanded view);
    target: [B] int64 in [1, row total]. Returns [B] int32. All sums are exact integers, so
    both strategies return the same t for the same row, whatever W is.
    """
    if keys.shape[1] > _SORT_MAX_WIDTH:
        return _radix_select(keys, weights, target)
    # Narrow domains: a sort is cheap, and the [B, 2**11] radix histograms would dominate.
    sorted_keys, order = keys.sort(dim=1, descending=True)
    cum = weights.expand_as(keys).gather(1, order).cumsum(1)
    # The key at which the running mass first reaches the target.
    first = (cum < target.unsqueeze(1)).sum(1, keepdim=True).clamp_(max=keys.shape[1] - 1)
    return sorted_keys.gather(1, first).squeeze(1)


def _radix_select(keys: Tensor, weights: Tensor, target: Tensor) -> Tensor:
    """``_threshold`` for wide domains, without sorting.

    Three histogram passes of 11/11/10 bits; the buckets of the later passes are offset by
    one so that keys outside the chosen prefix land in a bucket below (index 0) or above (last
    index) the real digits, and the "above" bucket carries the mass already known to be over
    the threshold.
    """
    rows = keys.shape[0]
    prefix = torch.zeros(rows, dtype=torch.int64, device=keys.device)
    goal = target.unsqueeze(1)
    # One int64 buffer (scatter indices must be int64) for all passes: fresh [B, V] outputs
    # cost more than the shifts on CPU.
    bucket = torch.empty(keys.shape, dtype=torch.int64, device=keys.device)
    for level, (shift, width) in enumerate(_RADIX_PASSES):
        digits = 1 << width
        torch.bitwise_right_shift(keys, shift, out=bucket)
        if level == 0:
            nbins, offset = digits, 1
        else:
            bucket.sub_((prefix.unsqueeze(1) << width) - 1).clamp_(0, digits + 1)
            nbins, offset = digits + 2, 2
        hist = torch.zeros(rows, nbins, dtype=torch.int64, device=keys.device)
        hist.scatter_add_(1, bucket, weights)
        cum = hist.cumsum(1)
        at_or_above = cum[:, -1:] - cum + hist
        # at_or_above falls as the bucket rises: the count of buckets meeting the goal is one
        # past the highest such bucket.
        digit = (at_or_above >= goal).sum(1).sub_(offset).clamp_(0, digits - 1)
        prefix = (prefix << width) | digit
    return prefix.to(torch.int32)


def _mass_target(fraction: Tensor, total: Tensor) -> Tensor:
    """ceil(fraction * total) clamped to [1, total]; float64 because total reaches 2**55."""
    t = torch.ceil(fraction.to(torch.float64) * total.to(torch.float64)).to(torch.int64)
    return torch.minimum(t.clamp_(min=1), total.clamp(min=1))


def _or_(acc: Tensor | None, mask: Tensor) -> Tensor:
    return mask if acc is None else acc.logical_or_(mask)


def removal_mask(xs: Tensor, e: Tensor, w: Tensor, st: SamplingTensors,
                 hints: SamplerHints) -> Tensor | None:
    """[B, W] bool, True where top-k / top-p / min-p / typical-p drop the token.

    ``xs`` holds temperature-scaled logits of a domain containing each row's max (the whole
    vocabulary, or each row's top ``max_top_k``); ``e, w = mass_weights(xs)``. Each cut sees
    the previous cuts, as HF's warper chain does. Cuts compare p / p_max, so tokens whose
    logits differ by less than its float32 resolution tie, and ties at a cut are all kept
    (HF's top-k does the same; its top-p/typical break ties by sort position instead).
    Returns None when nothing is cut.
    """
    rows, width = xs.shape
    remove: Tensor | None = None
    # p / p_max >= 0, so its float32 bits order the tokens like their probabilities.
    keys = e.view(torch.int32)
    if hints.any_top_k:
        k = st.top_k.to(torch.int64)
        ones = torch.ones((1, 1), dtype=torch.int64, device=xs.device).expand(rows, width)
        tau = _threshold(keys, ones, k.clamp(1, width))
        tau = torch.where((k <= 0) | (k >= width), 0, tau)
        remove = keys < tau.unsqueeze(1)
    if hints.any_top_p:
        mass = w if remove is None else w.masked_fill(remove, 0)
        # Keep the minimal head whose mass reaches top_p: HF removes tokens whose ascending
        # cumulative probability is <= 1 - top_p, i.e. those with >= top_p of mass above them.
        tau = _threshold(keys, mass, _mass_target(st.top_p, mass.sum(1)))
        tau = torch.where(st.top_p >= 1.0, 0, tau)
        remove = _or_(remove, keys < tau.unsqueeze(1))
    if hints.any_min_p:
        # p < min_p * p_max with the normaliser cancelled; min_p <= 1 always keeps the max.
        remove = _or_(remove, e < st.min_p.clamp(max=1.0).unsqueeze(1))
    if hints.any_typical:
        masked = xs if remove is None else xs.masked_fill(remove, float("-inf"))
        logp = torch.log_softmax(masked, dim=1)
        ent = (logp * logp.exp()).nansum(dim=1, keepdim=True).neg_()
        shifted = logp.neg_().sub_(ent).abs_()  # removed tokens: +inf
        # Ascending |-log p - H| as a descending key (bits of a float >= 0, complemented).
        skeys = shifted.view(torch.int32).bitwise_xor_(0x7FFFFFFF)
        mass = w if remove is None else w.masked_fill(remove, 0)
        # HF keeps every token whose shifted score is <= that of the first token (ascending)
        # at which the cumulative mass reaches typical_p.
        tau = _threshold(skeys, mass, _mass_target(st.typical_p, mass.sum(1)))
        off = (st.typical_p >= 1.0) | (st.typical_p <= 0.0)
        tau = torch.where(off, 0, tau)
        remove = _or_(remove, skeys < tau.unsqueeze(1))
    return remove


def _stop_columns(stop_ids: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """Scatter-safe stop columns [B, S] and whether each row has any stop id [B].

    Padding (and ids outside the vocabulary) points at the row's largest real stop id, so
    every write into that column carries the same value: the scatter stays deterministic on
    every backend without a padded [B, V + 1] copy of the logits.
    """
    valid = (stop_ids >= 0) & (stop_ids < vocab)
    ids = torch.where(valid, stop_ids, -1)
    fill = ids.amax(dim=1, keepdim=True)
    return torch.where(valid, ids, fill.clamp(min=0)), fill.squeeze(1) >= 0


def apply_penalties(logits: Tensor, st: SamplingTensors, seen: Tensor | None,
                    output_count: Tensor, any_penalty: bool, hints: SamplerHints,
                    inplace: bool = False, counts: Tensor | None = None,
                    may_block: Tensor | None = None) -> tuple[Tensor, bool]:
    """HF's logits processors (steps 1-3 of the module doc), for greedy and sampled rows.

    ``counts`` ([B, V] f32, how often each token was generated so far) turns the frequency
    and presence penalties on; it needs ``st.frequency_penalty`` and ``st.presence_penalty``.
    Returns the processed logits and whether they are a tensor this call owns (safe to
    modify in place). ``logits`` itself is only written when ``inplace``. ``may_block`` [B]
    bool: rows whose stop ids min_new_tokens may hold back (guided rows whose constraint
    allows nothing else keep them); None: every row.
    """
    x, owned = logits, inplace
    if x.dtype != torch.float32 or not x.is_contiguous():
        # The order keys reinterpret float32 bits, and half-precision logits would make the
        # kept sets differ from HF's float32 reference.
        x, owned = x.float().contiguous(), True
    if st.bias_ids is not None and st.bias_values is not None:
        # Ids are unique per row and padding adds 0.0, so the scatter's order cannot change a
        # sum: deterministic on every backend.
        x = (x.scatter_add_ if owned else x.scatter_add)(1, st.bias_ids, st.bias_values)
        owned = True
    if any_penalty:
        assert seen is not None, "any_penalty needs the seen mask"
        pen = st.repetition_penalty.unsqueeze(1)
        # HF: a seen token's score < 0 is multiplied by the penalty, otherwise divided.
        x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
        owned = True
    if counts is not None:
        assert st.frequency_penalty is not None and st.presence_penalty is not None, \
            "counts need the frequency and presence penalty columns"
        # vLLM's order: after the repetition penalty, before everything else.
        penalty = counts * st.frequency_penalty.unsqueeze(1)
        penalty.add_((counts > 0).to(counts.dtype).mul_(st.presence_penalty.unsqueeze(1)))
        x = x.sub_(penalty) if owned else x - penalty
        owned = True
    stop = st.stop_token_ids
    if (hints.any_min_new_tokens or hints.any_length_penalty) and stop.shape[1] > 0:
        if not owned:
            x, owned = x.clone(), True
        cols, has_stop = _stop_columns(stop, x.shape[1])
        vals = x.gather(1, cols)
        if hints.any_min_new_tokens:
            block = (output_count < st.min_new_tokens) & has_stop
            if may_block is not None:
                block &= may_block
            vals.masked_fill_(block.unsqueeze(1), float("-inf"))
        if hints.any_length_penalty:
            # HF: once n = output_count passes start, stop logits += |logit| * (decay**(n -
            # start) - 1); the factor is exactly 0 at n <= start and for decay 1.
            steps = (output_count - st.lp_start).clamp(min=0).to(torch.float32)
            factor = torch.where(has_stop, torch.pow(st.lp_decay, steps) - 1.0, 0.0)
            bonus = vals.abs().mul_(factor.unsqueeze(1))
            bonus.masked_fill_(~torch.isfinite(vals), 0.0)
            vals.add_(bonus)
        x.scatter_(1, cols, vals)
    return x, owned


class Sampler:
    """Vectorised, seeded, sync-free sampler: one call per decode step for the whole batch."""

    def __call__(self, logits: Tensor, rows: SamplingBatch, output_count: Tensor, *,
                 inplace: bool = False, mask: LogitsMask | None = None,
                 may_block: Tensor | None = None) -> SamplerOutput:
        """Sample one token per row.

        logits: [B, V] f32 raw model logits (written only when ``inplace``). rows: the
        batch's parameters, token tables and host facts (:class:`SamplingBatch`).
        output_count: [B] int32 tokens generated before this step. mask: the guided rows'
        forbidden tokens (step 4); may_block: see ``apply_penalties``.

        Logprobs, ranks and top-n alternatives are taken from ``log_softmax`` of the logits
        after the penalties (steps 1-3) and the temperature but BEFORE the top-k / top-p /
        min-p / typical-p truncation, so they describe the model's (penalised, tempered)
        distribution and stay comparable across requests whatever truncation each uses;
        greedy rows use temperature 1. rank = 1 + number of tokens with a strictly larger
        logprob. They ignore the guided mask too: the model's distribution, not the draw's.
        """
        st, hints, all_greedy = rows.params, rows.hints, rows.all_greedy
        need_logprobs, max_top_n = rows.need_logprobs, rows.max_top_n
        x, owned = apply_penalties(logits, st, rows.seen, output_count, rows.any_penalty, hints,
                                   inplace, rows.counts, may_block)
        is_greedy = st.temperature <= 0
        if not all_greedy:  # greedy rows divide by 1: their argmax is unchanged
            temp = torch.where(is_greedy, 1.0, st.temperature).unsqueeze(1)
            x, owned = (x.div_(temp) if owned else x / temp), True
        lp = torch.log_softmax(x, dim=1) if need_logprobs or max_top_n > 0 else None
        if mask is not None:
            x = x if owned else x.clone()
            mask(x)
        if all_greedy:
            tokens = x.argmax(dim=1)
        else:
            tokens = self._draw(x, st, output_count, hints)
            if hints.any_greedy:
                tokens = torch.where(is_greedy, x.argmax(dim=1), tokens)
        out = SamplerOutput(tokens, None, None, None, None)
        if lp is not None:
            if need_logprobs:
                chosen = lp.gather(1, tokens.unsqueeze(1))
                out.logprobs = chosen.squeeze(1)
                out.ranks = (lp > chosen).sum(dim=1, dtype=torch.int32).add_(1)
            if max_top_n > 0:
                out.top_logprobs, out.top_ids = torch.topk(lp, min(max_top_n, lp.shape[1]),
                                                            dim=1)
        return out

    def _draw(self, xs: Tensor, st: SamplingTensors, output_count: Tensor,
              hints: SamplerHints) -> Tensor:
        """Inverse-CDF draw over the kept tokens, in token-id order, in exact integers.

        The row's uniform depends only on (seed, output_count) and the CDF only on the row's
        own logits, with integer weights whose sums are exact: the draw is the same whatever
        else is in the batch, whatever the row index, on any reduction order, and whichever
        domain (whole vocabulary or the top ``max_top_k``) the batch uses.
        """
        vals, ids = _domain(xs, hints)
        e, w = mass_weights(vals)
        remove = removal_mask(vals, e, w, st, hints)
        if remove is not None:
            w.masked_fill_(remove, 0)
        cdf = w.cumsum_(dim=1)
        total = cdf[:, -1]
        u = row_uniform(st.seed, output_count)
        # Every kept token of nonzero probability weighs >= 1, so total >= 1, target < total.
        target = torch.minimum((u * total.to(torch.float64)).to(torch.int64), total - 1)
        pos = torch.searchsorted(cdf, target.unsqueeze(1), right=True)
        return pos.squeeze(1) if ids is None else ids.gather(1, pos).squeeze(1)

    def warped_logits(self, logits: Tensor, rows: SamplingBatch, output_count: Tensor
                      ) -> Tensor:
        """[B, V] scores the draw sees: processed, tempered, -inf where truncated.

        Greedy rows get the processed logits unscaled and untruncated (they take the
        argmax). For tests and debugging; the draw itself never materialises this.
        """
        st, hints = rows.params, rows.hints
        x, _ = apply_penalties(logits, st, rows.seen, output_count, rows.any_penalty, hints,
                               counts=rows.counts)
        is_greedy = st.temperature <= 0
        xs = x / torch.where(is_greedy, 1.0, st.temperature).unsqueeze(1)
        vals, ids = _domain(xs, hints)
        e, w = mass_weights(vals)
        remove = removal_mask(vals, e, w, st, hints)
        if remove is not None:
            vals = vals.masked_fill(remove, float("-inf"))
        out = vals if ids is None else torch.full_like(xs, float("-inf")).scatter_(1, ids, vals)
        return torch.where(is_greedy.unsqueeze(1), x, out)


def _domain(xs: Tensor, hints: SamplerHints) -> tuple[Tensor, Tensor | None]:
    """The candidates of each row: all of ``xs`` (ids None), or its top ``max_top_k``.

    The top-k candidates are put in token-id order so that their CDF has exactly the partial
    sums the whole-vocabulary CDF has at those tokens.
    """
    if not 0 < hints.max_top_k < xs.shape[1]:
        return xs, None
    vals, ids = torch.topk(xs, hints.max_top_k, dim=1, sorted=False)
    ids, order = ids.sort(dim=1)
    return vals.gather(1, order), ids

