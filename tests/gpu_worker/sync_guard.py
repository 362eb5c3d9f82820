"""A guard that fails loudly when code reads device values back to the host.

The decode loop runs K steps back to back on the device; a single ``.item()`` or boolean-mask
index inside it stalls the host until the device catches up and serialises the pipeline. Such
reads are easy to add by accident and invisible in CPU tests, so ``forbid_host_sync()`` turns
them into a :class:`HostSyncError`:

* a ``TorchDispatchMode`` rejects the ATen ops that need a device value on the host: scalar
  reads (``_local_scalar_dense``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``,
  ``if t:``), ops whose output shape depends on the data (``nonzero``, ``argwhere``,
  ``masked_select``, ``unique*``, ``bincount``, boolean-mask ``index`` / ``index_put``,
  ``repeat_interleave`` without ``output_size``), ops returning a Python bool (``equal``,
  ``allclose``, ``is_nonzero``) and blocking device-to-host copies. It works on CPU too,
  where the same code would sync on a GPU.
* ``Tensor.tolist`` and ``Tensor.numpy`` are wrapped while a guard is active on the calling
  thread: for CPU tensors they read memory directly without dispatching an ATen op.
* on CUDA, ``torch.cuda.set_sync_debug_mode("error")`` also catches synchronising CUDA calls
  made below the dispatcher; its RuntimeError is re-raised as :class:`HostSyncError`.

Non-blocking copies to pinned host memory are allowed: they are how the worker streams
tokens out without waiting.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "forbid_host_sync"]


class HostSyncError(RuntimeError):
    """Code inside ``forbid_host_sync()`` read a device value on the host."""


_aten = torch.ops.aten

# Always a host read, whatever the arguments.
_ALWAYS: dict[Any, str] = {
    _aten._local_scalar_dense: "reads a scalar to the host (.item(), int(), float(), bool())",
    _aten.item: "reads a scalar to the host",
    _aten.is_nonzero: "reads a scalar to the host (bool(t))",
    _aten.equal: "returns a Python bool",
    _aten.allclose: "returns a Python bool",
    _aten.nonzero: "has a data-dependent output shape (use nonzero_static or a mask)",
    _aten.nonzero_numpy: "has a data-dependent output shape",
    _aten.argwhere: "has a data-dependent output shape",
    _aten.masked_select: "has a data-dependent output shape (use torch.where)",
    _aten._unique: "has a data-dependent output shape",
    _aten._unique2: "has a data-dependent output shape",
    _aten.unique_dim: "has a data-dependent output shape",
    _aten.unique_consecutive: "has a data-dependent output shape",
    _aten.unique_dim_consecutive: "has a data-dependent output shape",
    _aten.bincount: "has a data-dependent output shape (minlength from the data)",
}


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _device_to_host(src: Any, dst_device: Any) -> bool:
    return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
            and dst_device is not None and torch.device(dst_device).type == "cpu")


def why_forbidden(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why running aten op `func` on these arguments would make the host wait for the
    device (None: it would not); public so the rules can be tested op by op."""
    packet = func.overloadpacket
    why = _ALWAYS.get(packet)
    if why is not None:
        return why
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        indices = kwargs.get("indices", args[1] if len(args) > 1 else None)
        if _has_bool_index(indices):
            return "indexes with a boolean mask (data-dependent shape; use torch.where)"
    elif packet is _aten.repeat_interleave and func is not _aten.repeat_interleave.self_int:
        if kwargs.get("output_size") is None:
            return "has a data-dependent output shape unless output_size is given"
    elif packet is _aten.histc:
        lo = kwargs.get("min", args[2] if len(args) > 2 else 0)
        hi = kwargs.get("max", args[3] if len(args) > 3 else 0)
        if lo == hi:
            return "reads the data range to the host when min == max"
    elif packet is _aten._to_copy:
        if _device_to_host(args[0], kwargs.get("device")) and not kwargs.get("non_blocking"):
            return "copies device memory to the host and waits for it"
    elif packet is _aten.copy_:
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if _device_to_host(src, dst.device) and not (non_blocking and dst.is_pinned()):
            return "copies device memory to host memory and waits for it"
    return None


class _ForbidHostSyncMode(TorchDispatchMode):
    # A higher-order operator (FlexAttention's) is torch's own fused kernel: it runs as one
    # op, unchecked inside; the ops around it are checked as ever.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        why = why_forbidden(func, args, kwargs)
        if why is not None:
            raise HostSyncError(f"{func} {why}; not allowed inside forbid_host_sync()")
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if "synchroniz" in str(e) and not isinstance(e, HostSyncError):
                raise HostSyncError(f"{func}: {e}") from e
            raise


# Methods that read CPU tensor memory without dispatching an ATen op.
_WRAPPED_METHODS = ("tolist", "numpy")

_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_originals: dict[str, tuple[bool, Callable[..., Any]]] = {}


def _guard_active() -> bool:
    return getattr(_local, "depth", 0) > 0


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _guard_active():
            raise HostSyncError(f"Tensor.{name}() reads tensor values on the host; "
                                "not allowed inside forbid_host_sync()")
        return original(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = original.__doc__
    return method


def _install_patches() -> None:
    # Reference-counted because guards may be active on several threads at once; the
    # wrappers only fire on threads whose own guard is active.
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            for name in _WRAPPED_METHODS:
                own = name in torch.Tensor.__dict__
                original = getattr(torch.Tensor, name)
                _originals[name] = (own, original)
                setattr(torch.Tensor, name, _wrap(name, original))
        _patch_users += 1


def _remove_patches() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            for name, (own, original) in _originals.items():
                if own:
                    setattr(torch.Tensor, name, original)
                else:
                    delattr(torch.Tensor, name)
            _originals.clear()


@contextmanager
def forbid_host_sync(cuda_sync_debug: bool = True) -> Iterator[None]:
    """Raise :class:`HostSyncError` when code in the block reads device values to the host.

    Meant for tests and debug runs: every ATen op goes through a Python check while it is
    active. The dispatch check and the method wrappers only act on the calling thread, but
    CUDA's sync debug mode is process-wide: pass ``cuda_sync_debug=False`` when other
    threads (a token publisher waiting on copy events, say) may sync legitimately meanwhile.
    """
    cuda = cuda_sync_debug and torch.cuda.is_available()
    previous_mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    _install_patches()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        with _ForbidHostSyncMode():
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous_mode)
        _local.depth -= 1
        _remove_patches()
