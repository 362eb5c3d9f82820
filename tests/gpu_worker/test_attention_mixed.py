"""Mixed forwards: decode rows (device lengths, some masked) and prefill rows (fresh and after
a cached prefix) in one backend call, on the SDPA backend's split path and in the flex
backend's one FlexAttention call, against a dense causal reference (float32, 1e-5), with
sliding windows; no host read.
"""
from __future__ import annotations

import pytest
import torch

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from tandem_serve.gpu_worker.attention.flex import FlexBackend, FlexPlan
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend, SdpaPlan, length_groups
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.test_attention import (
    ATOL,
    KV_DTYPES,
    Scenario,
    Seq,
    attend,
    dense_reference,
)


@pytest.fixture(params=["sdpa", "flex"])
def backend(request: pytest.FixtureRequest) -> AttentionBackend:
    return SdpaBackend() if request.param == "sdpa" else FlexBackend()


@pytest.mark.parametrize("hq,hkv,block_size", [(4, 2, 16), (4, 1, 8), (6, 6, 4)])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_mixed_rows_match_dense(backend: AttentionBackend, hq: int, hkv: int, block_size: int,
                                window: int | None, kv_dtype: torch.dtype) -> None:
    d = 16
    sc = Scenario(hq, hkv, d, block_size, num_blocks=96, seed=hq * 10 + hkv + block_size,
                  dtype=kv_dtype)
    decode = [sc.add(n, 1) for n in (1, 30, block_size + 1, 57)]
    masked = sc.add(20, 1)  # a finished row: writes the scratch block, output ignored
    prefill_shapes = [(40, 40), (75, 17), (block_size * 3, 1), (90, 33)]
    prefill = [sc.add(n, q) for n, q in prefill_shapes]
    rows: list[Seq] = [*decode, masked, *prefill]
    num_decode = len(decode) + 1
    q_parts, k_parts, v_parts, slots = [], [], [], []
    for s in rows:
        n, ql = len(s.k), len(s.q)
        q_parts.append(s.q)
        k_parts.append(s.k[n - ql:])
        v_parts.append(s.v[n - ql:])
        slots += [-1] if s is masked else [sc.slot(s, p) for p in range(n - ql, n)]
    q_lens = [len(s.q) for s in rows]
    seq_lens = [len(s.k) for s in rows]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=sc.block_tables(rows, pad=0),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl, query_lens=q_lens, max_seq_len=max(seq_lens) + 3,
        is_decode=False, num_decode=num_decode,
        decode_max_seq_len=max(seq_lens[:num_decode]) + 5,
        prefill_seq_lens=seq_lens[num_decode:])
    before = [c.clone() for c in sc.cache]
    scale = d**-0.5
    with forbid_host_sync():
        plan = backend.prepare(meta, sc.cache, (window,))
        assert isinstance(plan, FlexPlan if backend.name == "flex" else SdpaPlan)
        out = backend.forward(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts),
                              sc.cache, plan, scale, window)
    assert torch.isfinite(out).all()
    for i, s in enumerate(rows):
        if s is masked:
            continue
        got = out[int(qsl[i]): int(qsl[i + 1])]
        torch.testing.assert_close(got, sc.reference(s, scale, window), atol=ATOL, rtol=0)
    expected = [c.clone() for c in before]
    for s in rows:
        if s is masked:
            continue
        for p in range(len(s.k) - len(s.q), len(s.k)):
            expected[0][s.blocks[p // block_size], p % block_size] = s.k[p]
            expected[1][s.blocks[p // block_size], p % block_size] = s.v[p]
    for c, e in zip(sc.cache, expected, strict=True):
        assert torch.equal(c[:-1], e[:-1])


@pytest.mark.parametrize("window", [None, 9])
def test_decode_rows_far_apart_in_length_gather_in_two_groups(window: int | None) -> None:
    """A long row among short ones: with host bounds per row the short rows gather to their
    own width (two groups), and every row still matches the dense reference."""
    hq, hkv, d, bs = 4, 2, 16, 8
    sc = Scenario(hq, hkv, d, bs, num_blocks=96, seed=11)
    rows = [sc.add(n, 1) for n in (20, 300, 9, 33, 17)]
    lens = [len(s.k) for s in rows]
    groups = length_groups(lens, bs)
    assert groups is not None and sorted(groups[1][0]) == [1] and groups[0][1] == 33
    assert length_groups([20, 30, 25], bs) is None, "nothing to save: one gather"
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([sc.slot(s, len(s.k) - 1) for s in rows]),
        block_tables=sc.block_tables(rows), seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=None, query_lens=None, max_seq_len=max(lens), is_decode=True,
        decode_lens=lens)
    assert len(SdpaBackend().prepare(meta, sc.cache).decode) == 2
    q = torch.stack([s.q[0] for s in rows])
    k = torch.stack([s.k[-1] for s in rows])
    v = torch.stack([s.v[-1] for s in rows])
    with forbid_host_sync():
        out = attend(q, k, v, sc.cache, meta, 0.25, window)
    for i, s in enumerate(rows):
        torch.testing.assert_close(out[i], dense_reference(s.q, s.k, s.v, 0.25, window)[0],
                                   atol=ATOL, rtol=0)
