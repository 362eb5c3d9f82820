"""Gemma 3's images in prefill attention: a query inside an image also sees that image's later
tokens (transformers' mask: causal OR same image, AND the sliding window behind the query).
The sdpa and flex backends against a dense float64 reference, in prefill forwards and mixed
ones (flex's one FlexAttention call), fresh rows and rows after a cached prefix, windows
shorter than an image; triton and flash refuse such a model at start-up, by name or in
`auto`."""
from __future__ import annotations

import pytest
import torch

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from tandem_serve.gpu_worker.attention.flex import FlexBackend
from tandem_serve.gpu_worker.attention.registry import check_backend, select_backend
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend
from tandem_serve.ipc.process import StartupError
from tests.gpu_worker.test_attention import ATOL, Scenario, Seq


def reference(s: Seq, spans: list[tuple[int, int]], scale: float, window: int | None
              ) -> torch.Tensor:
    lq, hq, _ = s.q.shape
    length, hkv, _ = s.k.shape
    k = s.k.double().repeat_interleave(hq // hkv, dim=1)
    v = s.v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", s.q.double(), k) * scale
    q_pos = torch.arange(length - lq, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    allowed = k_pos <= q_pos
    for a, b in spans:
        allowed |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("backend", [SdpaBackend(), FlexBackend()], ids=["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mixed", [False, True], ids=["prefill", "mixed"])
def test_a_query_in_an_image_sees_the_whole_image(backend: AttentionBackend,
                                                   window: int | None, mixed: bool) -> None:
    sc = Scenario(4, 2, 16, 8, num_blocks=64, seed=3)
    decode = [sc.add(n, 1) for n in (9, 30)] if mixed else []
    # (context, query, images as [start, end) positions, all inside the query)
    shapes = [(40, 40, [(3, 19), (22, 38)]), (50, 20, [(33, 45)]), (25, 10, [])]
    prefill = [sc.add(n, q) for n, q, _ in shapes]
    spans = [im for _, _, im in shapes]
    rows = [*decode, *prefill]
    q_lens = [len(s.q) for s in rows]
    seq_lens = [len(s.k) for s in rows]
    slots = [sc.slot(s, p) for s in rows for p in range(len(s.k) - len(s.q), len(s.k))]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(decode)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=sc.block_tables(rows, pad=0), seq_lens=torch.tensor(seq_lens,
                                                                         dtype=torch.int32),
        query_start_loc=qsl, query_lens=q_lens, max_seq_len=max(seq_lens), is_decode=False,
        num_decode=n, decode_max_seq_len=max(seq_lens[:n], default=0),
        prefill_seq_lens=seq_lens[n:], bidirectional=spans)
    scale = 0.25
    plan = backend.prepare(meta, sc.cache, (window,))
    out = backend.forward(torch.cat([s.q for s in rows]),
                          torch.cat([s.k[len(s.k) - len(s.q):] for s in rows]),
                          torch.cat([s.v[len(s.v) - len(s.q):] for s in rows]),
                          sc.cache, plan, scale, window)
    for i, s in enumerate(rows):
        got = out[int(qsl[i]): int(qsl[i + 1])]
        want = reference(s, spans[i - n] if i >= n else [], scale, window)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # The images changed something: causal attention differs inside them.
    causal = reference(prefill[0], [], scale, window)
    assert not torch.allclose(out[int(qsl[n]): int(qsl[n + 1])], causal, atol=1e-3)


def test_triton_and_flash_refuse_a_model_whose_images_attend_both_ways() -> None:
    cpu = torch.device("cpu")
    for name in ("triton", "flash"):
        with pytest.raises(StartupError, match=f"--attention-backend {name}: cannot attend "
                                               "both ways among an image's tokens"):
            check_backend(name, cpu, torch.float32, torch.float32, 256, bidirectional=True)
    chosen = select_backend("auto", cpu, torch.float32, torch.float32, 16, bidirectional=True)
    assert chosen.name == "sdpa"
    check_backend("sdpa", cpu, torch.float32, torch.float32, 16, bidirectional=True)
