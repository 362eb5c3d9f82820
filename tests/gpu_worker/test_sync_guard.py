"""forbid_host_sync() rejects every way of reading tensor values on the host, and only those."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu_worker.sync_guard import HostSyncError, forbid_host_sync, why_forbidden

aten = torch.ops.aten


def _vec() -> torch.Tensor:
    return torch.tensor([3.0, -1.0, 2.0, 0.0])


def _set_masked(t: torch.Tensor) -> None:
    t[t > 0] = 0.0


SYNCS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "item": lambda t, s: s.item(),
    "tolist": lambda t, s: t.tolist(),
    "tolist_0d": lambda t, s: s.tolist(),
    "int": lambda t, s: int(s),
    "float": lambda t, s: float(s),
    "bool": lambda t, s: bool(s),
    "if": lambda t, s: 1 if (t > 0).any() else 0,
    "index_by_tensor": lambda t, s: [0, 1, 2, 3][s.long()],
    "range": lambda t, s: range(s.long()),
    "nonzero": lambda t, s: t.nonzero(),
    "torch_nonzero": lambda t, s: torch.nonzero(t),
    "where_1arg": lambda t, s: torch.where(t > 0),
    "argwhere": lambda t, s: torch.argwhere(t),
    "bool_mask_index": lambda t, s: t[t > 0],
    "bool_mask_put": lambda t, s: _set_masked(t),
    "masked_select": lambda t, s: torch.masked_select(t, t > 0),
    "unique": lambda t, s: torch.unique(t),
    "unique_consecutive": lambda t, s: torch.unique_consecutive(t),
    "repeat_interleave": lambda t, s: torch.repeat_interleave(t, torch.tensor([1, 2, 0, 1])),
    "bincount": lambda t, s: torch.bincount(t.long().clamp(min=0)),
    "equal": lambda t, s: torch.equal(t, t),
    "allclose": lambda t, s: torch.allclose(t, t),
    "numpy": lambda t, s: t.numpy(),
    "np_asarray": lambda t, s: np.asarray(t),
    "repr": lambda t, s: repr(t),
    "max_reduce_item": lambda t, s: t.max().item(),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_guard_catches_host_reads(name: str) -> None:
    t, s = _vec(), torch.tensor(2.0)
    with pytest.raises(HostSyncError), forbid_host_sync():
        SYNCS[name](t, s)


def test_host_sync_error_is_a_runtime_error() -> None:
    assert issubclass(HostSyncError, RuntimeError)


def test_guard_lets_device_math_through() -> None:
    t = torch.randn(4, 50)
    idx = torch.tensor([[1], [3], [0], [2]])
    with forbid_host_sync():
        u = torch.where(t > 0, t * 2, t.exp())
        u = u.log_softmax(1).gather(1, idx).squeeze(1)
        v, i = torch.topk(t, 5)
        w = t.sort(dim=1).values.cumsum(1)
        x = t.masked_fill(t < 0, float("-inf")).argmax(1)
        y = t[torch.tensor([0, 2])]  # integer-index gather: no data-dependent shape
        z = torch.zeros(4, 50).scatter_add_(1, i, v)
        nz = torch.nonzero_static(t > 0, size=8)
        rep = torch.repeat_interleave(t[:, 0], torch.tensor([1, 2, 0, 1]), output_size=4)
        t.add_(1.0)
        shape_info = (t.shape[0], t.dim(), t.numel(), len(t), t.dtype, t.device)
        const = torch.tensor([1, 2, 3]) + torch.arange(3)
        k = (t @ t.T).diagonal() + torch.full((4,), 2.0)
    assert shape_info[0] == 4
    for out in (u, v, w, x, y, z, nz, rep, const, k):
        assert isinstance(out, torch.Tensor)


def test_guard_is_undone_on_exit_even_after_an_error() -> None:
    original_tolist = torch.Tensor.tolist
    with pytest.raises(HostSyncError), forbid_host_sync():
        torch.tensor(1).item()
    assert torch.Tensor.tolist is original_tolist
    assert torch.tensor([1, 2]).tolist() == [1, 2]
    assert torch.tensor(3).item() == 3


def test_guards_nest() -> None:
    with forbid_host_sync():
        with forbid_host_sync():
            pass
        with pytest.raises(HostSyncError):
            torch.tensor([1]).tolist()
    assert torch.tensor([1]).tolist() == [1]


def test_guard_only_affects_its_own_thread() -> None:
    inside, outside = threading.Event(), threading.Event()
    result: list[Any] = []

    def other() -> None:
        inside.wait(5)
        result.append(torch.tensor([4, 5]).tolist())
        result.append(torch.tensor(6).item())
        outside.set()

    th = threading.Thread(target=other)
    th.start()
    with forbid_host_sync():
        inside.set()
        assert outside.wait(5)
    th.join()
    assert result == [[4, 5], 6]


def test_device_to_host_copy_rules() -> None:
    dev = torch.empty(3, device="meta")
    cpu = torch.empty(3)
    cpu_dev = torch.device("cpu")
    assert why_forbidden(aten._to_copy.default, (dev,), {"device": cpu_dev}) is not None
    assert why_forbidden(aten._to_copy.default, (dev,),
                          {"device": cpu_dev, "non_blocking": True}) is None
    assert why_forbidden(aten._to_copy.default, (cpu,), {"device": cpu_dev}) is None
    assert why_forbidden(aten._to_copy.default, (cpu,), {"dtype": torch.int32}) is None
    # Blocking copy into host memory, or non-blocking into pageable memory, waits.
    assert why_forbidden(aten.copy_.default, (cpu, dev), {}) is not None
    assert why_forbidden(aten.copy_.default, (cpu, dev, True), {}) is not None
    assert why_forbidden(aten.copy_.default, (cpu, cpu), {}) is None
    assert why_forbidden(aten.copy_.default, (dev, cpu), {}) is None
    with pytest.raises(HostSyncError), forbid_host_sync():
        dev.cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sync_debug_mode() -> None:
    before = torch.cuda.get_sync_debug_mode()
    t = torch.arange(10, device="cuda")
    with forbid_host_sync():
        assert torch.cuda.get_sync_debug_mode() == 2
        (t * 2).cumsum(0)
        with pytest.raises(HostSyncError):
            t.sum().item()
        with pytest.raises(HostSyncError):
            t.cpu()
        with pytest.raises(HostSyncError):
            t.tolist()
        pinned = torch.empty(10, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t, non_blocking=True)
    assert torch.cuda.get_sync_debug_mode() == before
    torch.cuda.synchronize()
