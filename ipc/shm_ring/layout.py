"""The ring's shared-memory layout, its constants and errors, and the helpers both ends use.

The protocol itself (who writes what, in which order, and why that is safe) is described in
`ipc.shm_ring`'s docstring.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from typing import Final, Literal

try:  # the C helper SharedMemory itself uses; needed to open/unlink without resource_tracker
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

log = logging.getLogger("ipc.shm_ring")

Frame = bytes | memoryview

MAGIC: Final = 0x314D52444E4154  # "TANDRM1" little-endian
VERSION: Final = 1
LINE: Final = 64
MAX_READERS: Final = 64
MIN_SLOT_SIZE: Final = 256
SIDE_MARKER: Final = 0xFFFFFFFF

# header words
H_MAGIC, H_VERSION, H_READERS, H_SLOTS, H_SLOT_SIZE = 0, 1, 2, 3, 4
H_WRITER_PID, H_WRITER_NS, H_WRITER_STATE = 5, 6, 7
# reader line words
R_PID, R_STATE, R_NS = 0, 1, 2
STATE_NONE, STATE_OPEN, STATE_CLOSED = 0, 1, 2

U32 = struct.Struct("<I")
SEQ = struct.Struct("<Q")

DEFAULT_SPIN_S: Final = 100e-6  # a busy writer publishes within this; longer only burns CPU
WAKE_S: Final = 0.5  # readers surface at least this often to re-check the writer
LIVENESS_EVERY_S: Final = 0.1  # how often a waiting side looks at its peers' pids
SIDE_LINGER_MS: Final = 1000  # let queued side messages reach live readers on close

_fence_lock = threading.Lock()
fence_acquire = _fence_lock.acquire
fence_release = _fence_lock.release

HEADS: dict[int, struct.Struct] = {}


def head_struct(count: int) -> struct.Struct:
    """Slot header for `count` frames: the count, then one u32 length per frame."""
    head = HEADS[count] = struct.Struct(f"<I{count}I")
    return head


def full_fence() -> None:
    # An uncontended acquire/release is an atomic read-modify-write (lock cmpxchg on x86),
    # which orders every earlier store before every later load.  See module docstring.
    fence_acquire()
    fence_release()


class RingError(RuntimeError):
    """The ring is unusable (protocol violation, closed end, bad segment)."""


class RingReaderDied(RingError):
    def __init__(self, reader_index: int, detail: str = "died") -> None:
        super().__init__(f"shm ring reader {reader_index} {detail}")
        self.reader_index = reader_index


class RingWriterDied(RingError):
    """The writer process is gone and nothing more can arrive."""


class RingClosed(RingError):
    """The writer closed the ring cleanly and every message was read."""


def segment_layout(num_readers: int, num_slots: int,
                   slot_size: int) -> tuple[int, int, int, int, int, int]:
    """Offsets of (readers, sleeping, seqs, flags, data) and the total size."""
    readers = LINE
    sleeping = readers + LINE * num_readers
    seqs = sleeping + LINE
    flags = seqs + round_up(8 * num_slots, LINE)
    data = flags + LINE * num_slots
    total = data + slot_size * num_slots
    return readers, sleeping, seqs, flags, data, total


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def same_namespace(a: int, b: int) -> bool:
    # 0 means "unknown"; assume one host then, which is how the launcher runs things.
    return a == 0 or b == 0 or a == b


def pid_alive(pid: int) -> bool:
    """True if `pid` runs.  A zombie (dead, not yet reaped by its parent) counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The command name may contain spaces and ')' - the state follows the last ')'.
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


def _ipc_path(addr: str) -> str | None:
    if not addr.startswith("ipc://"):
        return None
    path = addr[len("ipc://"):]
    return None if path.startswith("@") else path  # '@' is Linux's abstract namespace, no file


def unlink_ipc_file(addr: str) -> None:
    """Remove the socket file of an `ipc://` address (idempotent; other schemes: no-op)."""
    path = _ipc_path(addr)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def unlink_segment(name: str) -> None:
    """Remove shared-memory segment `name` if it exists (idempotent).

    For a launcher after its children exit: a writer killed by SIGKILL cannot unlink its own
    segment.  Goes straight to shm_unlink so no resource_tracker is involved.
    """
    shm_name = "/" + name.lstrip("/")
    if _posixshmem is not None:
        try:
            _posixshmem.shm_unlink(shm_name)
        except FileNotFoundError:
            pass
        return
    try:  # pragma: no cover - platforms without _posixshmem
        os.unlink("/dev/shm" + shm_name)
    except FileNotFoundError:
        pass


def open_untracked(name: str) -> mmap.mmap:
    """Map an existing segment without registering it with multiprocessing's resource_tracker.

    SharedMemory(name) registers every attach (Python 3.11), so the tracker would unlink the
    writer's segment - or warn about a "leak" - when a reader exits; and with a tracker shared
    by parent and children, a reader's unregister would drop the writer's own registration.
    """
    if _posixshmem is None:  # pragma: no cover
        raise RingError("POSIX shared memory is not available on this platform")
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise RingError(f"shm ring {name}: segment is still empty")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def byte_view(frame: Frame) -> bytes | memoryview:
    """A 1-D unsigned-byte view of a frame (numpy arrays arrive as typed memoryviews)."""
    if type(frame) is bytes:
        return frame
    view = memoryview(frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        return view.tobytes()
    return view.cast("B")


class Views:
    """Typed memoryviews over one mapping; all must be released before the mapping closes."""

    def __init__(self, buf: memoryview, num_readers: int, num_slots: int) -> None:
        readers, sleeping, seqs, flags, data, _ = segment_layout(num_readers, num_slots, 0)
        self._made: list[memoryview] = []
        self.header = self._view(buf, 0, LINE, "q")
        self.readers = self._view(buf, readers, sleeping, "q")
        self.sleeping = self._view(buf, sleeping, sleeping + LINE, "B")
        self.sleep_words = self._view(buf, sleeping, sleeping + LINE, "Q")
        self.seqs = self._view(buf, seqs, seqs + 8 * num_slots, "q")
        self.flags = self._view(buf, flags, data, "B")
        self.flag_words = self._view(buf, flags, data, "Q")
        self.data_off = data

    def _view(self, buf: memoryview, start: int, stop: int,
              fmt: Literal["q", "Q", "B"]) -> memoryview:
        part = buf[start:stop]
        view = part.cast(fmt)
        self._made += [part, view]
        return view

    def release(self) -> None:
        for view in reversed(self._made):
            view.release()
        self._made.clear()
