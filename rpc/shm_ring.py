"""Shared-memory broadcast ring for token batches: one writer (gpu worker), N readers (postproc).

Every message goes to every reader.  A message is a list of frames (as `proto.codec.encode`
produces them); the ring stores frame count, frame lengths and the bytes in a fixed-size slot.
A message that does not fit a slot goes over a ZeroMQ side channel instead, and the slot holds
a small marker for it, so order is preserved.

Segment layout (every region starts on a 64-byte cache line)::

    header    8 x int64: magic, version, num_readers, num_slots, slot_size,
                         writer pid, writer pid namespace, writer state
    readers   per reader one line of int64: pid, state (0 none, 1 attached, 2 closed), pid ns
    sleeping  one byte per reader: "I am about to block on the doorbell"
    seqs      one int64 per slot: sequence number (1, 2, ...) of the message the slot holds
    flags     one 64-byte line per slot: one read flag byte per reader
    data      num_slots x slot_size bytes:
              u32 frame count (0xFFFFFFFF = "on the side channel"), u32 lengths[count], frames

Memory ordering.  The protocol relies on x86-64 TSO as seen from CPython: every access below is
one aligned load or store done inside an opaque C call, so neither compiler may move it across
another, and the CPU keeps stores in program order, loads in program order, and never lets a
store overtake an earlier load.  Hence:

* writer: clear the slot's read flags -> write length + payload -> store the sequence number.
  A reader that loads the new sequence number therefore sees the payload and sees its flag
  already cleared, so the flag it sets afterwards cannot be wiped by a late clear.
* reader: load the sequence number -> copy the payload out -> set its read flag.  The writer
  sees the flag only after the copies are done, so it never overwrites bytes still being read.
* sleeping readers are the one store->load pattern (Dekker): the reader stores sleeping=1 and
  then re-loads the sequence number; the writer stores the sequence number and then loads the
  sleeping flags.  x86 may reorder a store with a later load, so both sides put a full fence
  between the two (`_full_fence`: an uncontended lock acquire/release is a `lock cmpxchg`),
  which guarantees at least one side sees the other: no lost wake-up.
On weakly ordered CPUs (ARM) this module would need real acquire/release barriers.

Liveness.  Pids live in the header; `os.kill(pid, 0)` plus a zombie check in /proc tells a dead
peer (an unreaped child is a zombie that `kill(pid, 0)` still accepts).  Processes in different
pid namespaces cannot see each other's pids; the check is skipped then.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Final, Literal

import zmq

try:  # the C helper SharedMemory itself uses; needed to open/unlink without resource_tracker
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

log = logging.getLogger(__name__)

Frame = bytes | memoryview

_MAGIC: Final = 0x314D52444E4154  # "TANDRM1" little-endian
_VERSION: Final = 1
_LINE: Final = 64
MAX_READERS: Final = 64
MIN_SLOT_SIZE: Final = 256
_SIDE_MARKER: Final = 0xFFFFFFFF

# header words
_H_MAGIC, _H_VERSION, _H_READERS, _H_SLOTS, _H_SLOT_SIZE = 0, 1, 2, 3, 4
_H_WRITER_PID, _H_WRITER_NS, _H_WRITER_STATE = 5, 6, 7
# reader line words
_R_PID, _R_STATE, _R_NS = 0, 1, 2
_STATE_NONE, _STATE_OPEN, _STATE_CLOSED = 0, 1, 2

_U32 = struct.Struct("<I")
_SEQ = struct.Struct("<Q")

DEFAULT_SPIN_S: Final = 100e-6  # a busy writer publishes within this; longer only burns CPU
_WAKE_S: Final = 0.5  # readers surface at least this often to re-check the writer
_LIVENESS_EVERY_S: Final = 0.1  # how often a waiting side looks at its peers' pids
_SIDE_LINGER_MS: Final = 1000  # let queued side messages reach live readers on close

_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release

_HEADS: dict[int, struct.Struct] = {}


def _head_struct(count: int) -> struct.Struct:
    """Slot header for `count` frames: the count, then one u32 length per frame."""
    head = _HEADS[count] = struct.Struct(f"<I{count}I")
    return head


def _full_fence() -> None:
    # An uncontended acquire/release is an atomic read-modify-write (lock cmpxchg on x86),
    # which orders every earlier store before every later load.  See module docstring.
    _fence_acquire()
    _fence_release()


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


def _layout(num_readers: int, num_slots: int, slot_size: int) -> tuple[int, int, int, int, int,
                                                                         int]:
    """Offsets of (readers, sleeping, seqs, flags, data) and the total size."""
    readers = _LINE
    sleeping = readers + _LINE * num_readers
    seqs = sleeping + _LINE
    flags = seqs + _round_up(8 * num_slots, _LINE)
    data = flags + _LINE * num_slots
    total = data + slot_size * num_slots
    return readers, sleeping, seqs, flags, data, total


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _same_namespace(a: int, b: int) -> bool:
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


def _open_untracked(name: str) -> mmap.mmap:
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


def _byte_view(frame: Frame) -> bytes | memoryview:
    """A 1-D unsigned-byte view of a frame (numpy arrays arrive as typed memoryviews)."""
    if type(frame) is bytes:
        return frame
    view = memoryview(frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        return view.tobytes()
    return view.cast("B")


class _Views:
    """Typed memoryviews over one mapping; all must be released before the mapping closes."""

    def __init__(self, buf: memoryview, num_readers: int, num_slots: int) -> None:
        readers, sleeping, seqs, flags, data, _ = _layout(num_readers, num_slots, 0)
        self._made: list[memoryview] = []
        self.header = self._view(buf, 0, _LINE, "q")
        self.readers = self._view(buf, readers, sleeping, "q")
        self.sleeping = self._view(buf, sleeping, sleeping + _LINE, "B")
        self.sleep_words = self._view(buf, sleeping, sleeping + _LINE, "Q")
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


class RingWriter:
    """The single writer.  Creates the segment and binds the doorbell and side sockets.

    `put_frames` returns once the message is in the ring; the frames may be reused then.
    Call `wait_ready` before the first put: a doorbell or side message sent before a reader's
    subscription reached this socket would be lost (side messages wait for subscriptions).
    """

    # views over the segment, cached for the hot path (set by _create_segment)
    _buf: memoryview
    _seqs: memoryview
    _flag_view: memoryview
    _sleep_view: memoryview
    _data_off: int

    def __init__(self, name: str, num_readers: int, doorbell_addr: str, side_addr: str,
                 slot_size: int = 64 * 1024, num_slots: int = 64, *,
                 spin_s: float = DEFAULT_SPIN_S) -> None:
        if not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"num_readers must be 1..{MAX_READERS}, got {num_readers}")
        if slot_size < MIN_SLOT_SIZE:
            raise ValueError(f"slot_size must be >= {MIN_SLOT_SIZE}, got {slot_size}")
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2, got {num_slots}")
        self.name = name
        self.num_readers = num_readers
        self.num_slots = num_slots
        self.slot_size = _round_up(slot_size, _LINE)
        self.doorbell_addr = doorbell_addr
        self.side_addr = side_addr
        self._spin_s = spin_s
        self._seq = 0
        self._closed = False
        self._pid_ns = _pid_namespace()
        self._bell_seen: set[int] = set()
        self._side_seen: set[int] = set()
        self._bell_topics = [b"B" + i.to_bytes(2, "big") for i in range(num_readers)]
        self._flag_words = (num_readers + 7) // 8
        ones = b"\x01" * num_readers + b"\x00" * (8 * self._flag_words - num_readers)
        # (word, value) pairs of a slot's flag line once every reader has read it
        self._all_read = [(w, int.from_bytes(ones[8 * w:8 * w + 8], "little"))
                          for w in range(self._flag_words)]
        self._sleep_word_range = range(self._flag_words)
        self._shm: shared_memory.SharedMemory | None = None
        self._views: _Views | None = None
        self._ctx = zmq.Context(io_threads=1)
        self._bell: zmq.Socket[bytes] | None = None
        self._side: zmq.Socket[bytes] | None = None
        self._next_reader_check = 0.0
        try:
            self._bell = self._bind(zmq.XPUB, doorbell_addr, linger=0)
            self._side = self._bind(zmq.XPUB, side_addr, linger=_SIDE_LINGER_MS)
            self._create_segment()
        except BaseException:
            self._release()
            raise
        atexit.register(self.close)

    # -- setup ---------------------------------------------------------------------------

    def _bind(self, kind: int, addr: str, linger: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, linger)
        # Backlog is bounded by the ring itself: at most num_slots messages are in flight.
        sock.setsockopt(zmq.SNDHWM, 0)
        unlink_ipc_file(addr)  # a stale file from a crashed run would make bind fail
        sock.bind(addr)
        return sock

    def _create_segment(self) -> None:
        _, _, _, _, _, total = _layout(self.num_readers, self.num_slots, self.slot_size)
        try:
            shm = shared_memory.SharedMemory(name=self.name, create=True, size=total)
        except FileExistsError:
            self._reclaim_stale_segment()
            shm = shared_memory.SharedMemory(name=self.name, create=True, size=total)
        self._shm = shm
        assert shm.buf is not None
        views = _Views(shm.buf, self.num_readers, self.num_slots)
        self._views = views
        self._buf = shm.buf
        self._seqs = views.seqs
        self._flag_view = views.flag_words
        self._sleep_view = views.sleep_words
        self._data_off = views.data_off
        header = views.header
        header[_H_VERSION] = _VERSION
        header[_H_READERS] = self.num_readers
        header[_H_SLOTS] = self.num_slots
        header[_H_SLOT_SIZE] = self.slot_size
        header[_H_WRITER_PID] = os.getpid()
        header[_H_WRITER_NS] = self._pid_ns
        header[_H_WRITER_STATE] = _STATE_OPEN
        header[_H_MAGIC] = _MAGIC  # last: readers treat the header as valid once they see it

    def _reclaim_stale_segment(self) -> None:
        """A segment with our name exists: take it over only if its writer is dead."""
        try:
            mm = _open_untracked(self.name)
        except (FileNotFoundError, RingError):
            unlink_segment(self.name)
            return
        try:
            words = memoryview(mm)[:_LINE].cast("q")
            valid, pid = words[_H_MAGIC] == _MAGIC, words[_H_WRITER_PID]
            state = words[_H_WRITER_STATE]
            words.release()
        finally:
            mm.close()
        if valid and state == _STATE_OPEN and pid_alive(pid):
            raise FileExistsError(f"shm ring {self.name} is in use by writer pid {pid}")
        log.warning("shm ring %s: removing a stale segment of dead writer pid %d", self.name, pid)
        unlink_segment(self.name)

    # -- handshake -----------------------------------------------------------------------

    def _drain_subscriptions(self) -> None:
        """Record which readers' SUB sockets have subscribed (XPUB reports each one)."""
        for sock, seen in ((self._bell, self._bell_seen), (self._side, self._side_seen)):
            assert sock is not None
            while True:
                try:
                    msg = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                # b"\x01" + topic subscribes, b"\x00" + topic unsubscribes; only the per-reader
                # topics (B<idx> on the doorbell, H<idx> on the side socket) say who it is.
                if len(msg) == 4 and msg[1:2] in (b"B", b"H"):
                    index = int.from_bytes(msg[2:4], "big")
                    if msg[:1] == b"\x01":
                        seen.add(index)
                    else:
                        seen.discard(index)

    def _unready(self) -> list[int]:
        assert self._views is not None
        readers = self._views.readers
        return [i for i in range(self.num_readers)
                if readers[i * 8 + _R_STATE] != _STATE_OPEN
                or i not in self._bell_seen or i not in self._side_seen]

    def wait_ready(self, timeout: float) -> None:
        """Return once every reader has attached and subscribed; TimeoutError otherwise."""
        self._check_open()
        assert self._bell is not None and self._side is not None
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._bell, zmq.POLLIN)
        poller.register(self._side, zmq.POLLIN)
        while True:
            self._drain_subscriptions()
            missing = self._unready()
            if not missing:
                return
            self._check_readers(missing)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"shm ring {self.name}: reader(s) {missing} of {self.num_readers} did not "
                    f"attach within {timeout:g} s")
            poller.poll(max(1, int(min(remaining, 0.05) * 1000)))

    # -- liveness ------------------------------------------------------------------------

    def check_readers(self) -> None:
        """Raise RingReaderDied if an attached reader has died or closed.

        put_frames does this by itself (while it waits, and every 0.5 s otherwise); a writer
        with nothing to publish for a while can call it to notice a dead reader anyway.
        """
        self._check_readers(range(self.num_readers))

    def _check_readers(self, indices: Sequence[int]) -> None:
        """Raise RingReaderDied for the first of `indices` that is dead or closed (a reader
        that has not attached yet is neither)."""
        assert self._views is not None
        readers = self._views.readers
        for i in indices:
            state = readers[i * 8 + _R_STATE]
            if state == _STATE_CLOSED:
                raise RingReaderDied(i, "closed its end while the writer still needs it")
            if state == _STATE_OPEN:
                pid = readers[i * 8 + _R_PID]
                if (_same_namespace(self._pid_ns, readers[i * 8 + _R_NS])
                        and not pid_alive(pid)):
                    raise RingReaderDied(i, f"(pid {pid}) died")

    def _unread_by(self, slot: int) -> list[int]:
        assert self._views is not None
        flags = self._views.flags
        row = slot * _LINE
        return [i for i in range(self.num_readers) if not flags[row + i]]

    # -- writing -------------------------------------------------------------------------

    def _slot_free(self, slot: int) -> bool:
        assert self._views is not None
        words = self._views.flag_words
        base = slot * (_LINE // 8)
        for w, expected in self._all_read:
            if words[base + w] != expected:
                return False
        return True

    def _wait_slot_free(self, slot: int, deadline: float | None, timeout: float | None) -> None:
        start = time.monotonic()
        spin_end = start + self._spin_s
        next_check = start + _LIVENESS_EVERY_S
        nap = 50e-6
        while not self._slot_free(slot):
            now = time.monotonic()
            if now >= next_check:
                self._check_readers(self._unread_by(slot))
                next_check = now + _LIVENESS_EVERY_S
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"shm ring {self.name}: reader(s) {self._unread_by(slot)} did not read "
                    f"message {self._seq + 1 - self.num_slots} within {timeout:g} s")
            if now < spin_end:
                os.sched_yield()
            else:
                # Back off to 1 ms: a full ring means readers are behind by a whole ring, so
                # a millisecond of extra latency is noise while a spin would steal their CPU.
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)

    def _ensure_side_subscribers(self, deadline: float | None, timeout: float | None) -> None:
        assert self._side is not None
        next_check = time.monotonic()
        while len(self._side_seen) < self.num_readers:
            self._drain_subscriptions()
            missing = [i for i in range(self.num_readers) if i not in self._side_seen]
            if not missing:
                return
            now = time.monotonic()
            if now >= next_check:
                self._check_readers(missing)
                next_check = now + _LIVENESS_EVERY_S
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"shm ring {self.name}: reader(s) {missing} never subscribed "
                                   f"to the side channel within {timeout:g} s")
            self._side.poll(10, zmq.POLLIN)

    def put_frames(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Publish one message to every reader; blocks while the ring is full.

        Raises RingReaderDied if a reader it waits for is dead, TimeoutError after `timeout`.
        """
        # Hot path (a few µs per message matters here): locals, no helper calls when possible.
        if self._closed:
            raise RingError(f"shm ring {self.name}: writer is closed")
        n = self._seq + 1
        slot = (n - 1) % self.num_slots
        flag_words = self._flag_view
        fbase = slot * (_LINE // 8)
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        if now >= self._next_reader_check:  # a dead reader is an error even before it blocks us
            self._next_reader_check = now + _WAKE_S
            self._check_readers(range(self.num_readers))
        if n > self.num_slots:
            for w, expected in self._all_read:
                if flag_words[fbase + w] != expected:
                    self._wait_slot_free(slot, deadline, timeout)
                    break

        parts = [f if type(f) is bytes else _byte_view(f) for f in frames]
        count = len(parts)
        head = 4 + 4 * count
        fits = head + sum([len(p) for p in parts]) <= self.slot_size  # 1-D byte views
        if not fits:  # before touching the slot: a timeout here must leave the ring consistent
            self._ensure_side_subscribers(deadline, timeout)

        # Clear the read flags before the new sequence number becomes visible (see docstring).
        for w, _ in self._all_read:
            flag_words[fbase + w] = 0
        buf = self._buf
        off = self._data_off + slot * self.slot_size
        if fits:
            head_struct = _HEADS.get(count) or _head_struct(count)
            head_struct.pack_into(buf, off, count, *[len(p) for p in parts])
            pos = off + head
            for part in parts:
                end = pos + len(part)
                buf[pos:end] = part
                pos = end
        else:
            # Sent before the marker is published, so it is queued by the time a reader
            # looks for it; PUB/SUB keeps per-connection order, so readers see n after n-1.
            assert self._side is not None
            self._side.send_multipart([b"S" + _SEQ.pack(n), *parts], copy=True)
            _U32.pack_into(buf, off, _SIDE_MARKER)
        self._seqs[slot] = n  # publish
        self._seq = n
        _fence_acquire()  # full fence, see module docstring (inlined _full_fence)
        _fence_release()
        sleep_words = self._sleep_view
        for w in self._sleep_word_range:
            if sleep_words[w]:
                self._ring_sleepers()
                break

    def _ring_sleepers(self) -> None:
        assert self._views is not None and self._bell is not None
        sleeping = self._views.sleeping
        for i in range(self.num_readers):
            if sleeping[i]:
                # Byte store: clearing a whole word could erase a neighbour's fresh flag.  The
                # bell goes out after the clear, so the reader's current or next sleep sees it.
                sleeping[i] = 0
                self._bell.send(self._bell_topics[i])

    # -- shutdown ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RingError(f"shm ring {self.name}: writer is closed")

    def close(self) -> None:
        """Mark the ring closed, wake readers, close sockets, unlink the segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self._views is not None:
                self._views.header[_H_WRITER_STATE] = _STATE_CLOSED
                if self._bell is not None:
                    for topic in self._bell_topics:  # sleepers notice the close at once
                        self._bell.send(topic)
        finally:
            self._release()

    def _release(self) -> None:
        for sock in (self._bell, self._side):
            if sock is not None:
                sock.close()
        self._bell = self._side = None
        self._ctx.term()
        for addr in (self.doorbell_addr, self.side_addr):
            unlink_ipc_file(addr)
        if self._views is not None:
            self._views.release()
            self._views = None
        if self._shm is not None:
            self._shm.close()
            try:
                self._shm.unlink()  # also unregisters it from the resource tracker
            except FileNotFoundError:
                pass
            self._shm = None

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RingReader:
    """One of the N readers.  Attaches to an existing segment; never unlinks it.

    `get_frames` returns the next message (frames are private copies, or zero-copy ZeroMQ
    buffers for side-channel messages), or None after `timeout` seconds.  It raises
    RingWriterDied when the writer process is gone and RingClosed when the writer closed the
    ring, in both cases only once every message published before that has been returned.
    """

    # views over the segment, cached for the hot path (set by _attach)
    _seqs: memoryview
    _flags: memoryview
    _data_off: int

    def __init__(self, name: str, reader_index: int, doorbell_addr: str, side_addr: str, *,
                 attach_timeout: float = 10.0, spin_s: float = DEFAULT_SPIN_S) -> None:
        self.name = name
        self.index = reader_index
        self._spin_s = spin_s
        self._next = 1
        self._side_pending: int | None = None
        self._closed = False
        self._pid_ns = _pid_namespace()
        self._next_writer_check = 0.0
        self._mm: mmap.mmap | None = None
        self._buf: memoryview | None = None
        self._views: _Views | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._bell: zmq.Socket[bytes] | None = None
        self._side: zmq.Socket[bytes] | None = None
        try:
            self._attach(attach_timeout)
            self._connect(doorbell_addr, side_addr)
            assert self._views is not None
            line = self._views.readers
            line[reader_index * 8 + _R_PID] = os.getpid()
            line[reader_index * 8 + _R_NS] = self._pid_ns
            line[reader_index * 8 + _R_STATE] = _STATE_OPEN  # last: the writer counts this
        except BaseException:
            self._release()
            raise

    def _attach(self, attach_timeout: float) -> None:
        # The launcher may start readers before the writer has created the segment.
        deadline = time.monotonic() + attach_timeout
        while True:
            try:
                mm = _open_untracked(self.name)
                buf = memoryview(mm)
                if len(buf) >= _LINE:
                    header = buf[:_LINE].cast("q")
                    ok = header[_H_MAGIC] == _MAGIC
                    params = [header[i] for i in range(8)]
                    header.release()
                    if ok:
                        break
                buf.release()
                mm.close()
            except (FileNotFoundError, RingError):
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"shm ring {self.name}: no initialised segment appeared "
                                   f"within {attach_timeout:g} s")
            time.sleep(0.01)
        self._mm, self._buf = mm, buf
        if params[_H_VERSION] != _VERSION:
            raise RingError(f"shm ring {self.name}: layout version {params[_H_VERSION]}, "
                            f"this reader speaks {_VERSION}")
        self.num_readers = params[_H_READERS]
        self.num_slots = params[_H_SLOTS]
        self.slot_size = params[_H_SLOT_SIZE]
        if not 0 <= self.index < self.num_readers:
            raise ValueError(f"shm ring {self.name}: reader_index {self.index} out of range "
                             f"0..{self.num_readers - 1}")
        if len(buf) < _layout(self.num_readers, self.num_slots, self.slot_size)[-1]:
            raise RingError(f"shm ring {self.name}: segment smaller than its header says")
        views = self._views = _Views(buf, self.num_readers, self.num_slots)
        self._seqs, self._flags, self._data_off = views.seqs, views.flags, views.data_off
        line = self._views.readers
        state = line[self.index * 8 + _R_STATE]
        if state != _STATE_NONE:
            raise RingError(f"shm ring {self.name}: reader index {self.index} was already used "
                            f"(pid {line[self.index * 8 + _R_PID]})")

    def _connect(self, doorbell_addr: str, side_addr: str) -> None:
        self._ctx = zmq.Context(io_threads=1)
        index = self.index.to_bytes(2, "big")
        bell = self._ctx.socket(zmq.SUB)
        bell.setsockopt(zmq.LINGER, 0)
        bell.setsockopt(zmq.SUBSCRIBE, b"B" + index)
        bell.connect(doorbell_addr)
        self._bell = bell
        side = self._ctx.socket(zmq.SUB)
        side.setsockopt(zmq.LINGER, 0)
        side.setsockopt(zmq.RCVHWM, 0)  # a dropped side message would stall the ring
        side.setsockopt(zmq.SUBSCRIBE, b"S")
        # Never published; it tells the writer's XPUB that the b"S" subscription (sent first,
        # same pipe) is in place and whose it is.
        side.setsockopt(zmq.SUBSCRIBE, b"H" + index)
        side.connect(side_addr)
        self._side = side

    # -- liveness ------------------------------------------------------------------------

    def _writer_gone(self, force: bool) -> type[RingError] | None:
        """RingClosed / RingWriterDied if the writer can publish nothing more, else None."""
        assert self._views is not None
        header = self._views.header
        if header[_H_WRITER_STATE] == _STATE_CLOSED:
            return RingClosed
        now = time.monotonic()
        if not force and now < self._next_writer_check:
            return None
        self._next_writer_check = now + _LIVENESS_EVERY_S
        if (_same_namespace(self._pid_ns, header[_H_WRITER_NS])
                and not pid_alive(header[_H_WRITER_PID])):
            return RingWriterDied
        return None

    def _raise_gone(self, exc: type[RingError]) -> None:
        assert self._views is not None
        if exc is RingClosed:
            raise RingClosed(f"shm ring {self.name}: the writer closed the ring")
        pid = self._views.header[_H_WRITER_PID]
        raise RingWriterDied(f"shm ring {self.name}: writer (pid {pid}) died")

    # -- reading -------------------------------------------------------------------------

    def get_frames(self, timeout: float | None) -> list[Frame] | None:
        """Next message, or None if none arrived within `timeout` seconds (None: no limit)."""
        if self._closed:
            raise RingError(f"shm ring {self.name}: reader {self.index} is closed")
        if self._side_pending is not None:
            return self._recv_side(timeout)
        n = self._next
        slot = (n - 1) % self.num_slots
        if self._seqs[slot] != n and not self._wait(slot, n, timeout):
            return None
        # Hot path inlined from here on: a few hundred ns per call is a visible share of a
        # ~10 µs round trip.
        buf = self._buf
        assert buf is not None
        off = self._data_off + slot * self.slot_size
        (count,) = _U32.unpack_from(buf, off)
        if count == 1:
            (length,) = _U32.unpack_from(buf, off + 4)
            if length > self.slot_size - 8:
                raise RingError(f"shm ring {self.name}: corrupt slot {slot} (length {length})")
            frames: list[Frame] = [buf[off + 8:off + 8 + length].tobytes()]
        elif count == _SIDE_MARKER:
            self._flags[slot * _LINE + self.index] = 1  # the slot only held the marker
            self._next = n + 1
            self._side_pending = n
            return self._recv_side(timeout)
        else:
            frames = self._copy_frames(buf, off, count, slot)
        # Every copy above is complete before this store is visible (see module docstring).
        self._flags[slot * _LINE + self.index] = 1
        self._next = n + 1
        return frames

    def backlog(self) -> int:
        """Messages the writer has published that this reader has not returned yet.

        The writer fills slots in sequence order, so the unread ones are the run of slots from
        ours whose sequence numbers continue ours; cheap (one load per unread message).
        """
        if self._closed:
            return 0
        seqs, n, slots = self._seqs, self._next, self.num_slots
        count = 0
        while count < slots and seqs[(n - 1 + count) % slots] == n + count:
            count += 1
        return count + (self._side_pending is not None)  # a side message not yet returned

    def _copy_frames(self, buf: memoryview, off: int, count: int, slot: int) -> list[Frame]:
        if 4 + 4 * count > self.slot_size:
            raise RingError(f"shm ring {self.name}: corrupt slot {slot} (frame count {count})")
        lengths = (_HEADS.get(count) or _head_struct(count)).unpack_from(buf, off)[1:]
        pos = off + 4 + 4 * count
        if pos + sum(lengths) > off + self.slot_size:
            raise RingError(f"shm ring {self.name}: corrupt slot {slot} (lengths {lengths})")
        frames: list[Frame] = []
        for length in lengths:
            frames.append(buf[pos:pos + length].tobytes())
            pos += length
        return frames

    def _wait(self, slot: int, n: int, timeout: float | None) -> bool:
        views = self._views
        assert views is not None and self._bell is not None
        seqs = views.seqs
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        # Spin: the busy path (writer a few µs ahead) then costs no syscall beyond sched_yield.
        spin_end = now + (self._spin_s if timeout is None else min(self._spin_s, timeout))
        while time.monotonic() < spin_end:
            if seqs[slot] == n:
                return True
            os.sched_yield()
        sleeping = views.sleeping
        me = self.index
        while True:
            if seqs[slot] == n:
                return True
            gone = self._writer_gone(force=False)
            if gone is not None:
                if seqs[slot] == n:  # published just before the writer went away
                    return True
                self._raise_gone(gone)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            wait = _WAKE_S if deadline is None else min(_WAKE_S, deadline - now)
            sleeping[me] = 1
            _full_fence()  # the re-check below must not be answered before the flag is visible
            if seqs[slot] == n:
                sleeping[me] = 0
                return True
            if self._bell.poll(max(1, int(wait * 1000 + 0.999)), zmq.POLLIN):
                # Drain before clearing the flag: a bell that arrives later belongs to the next
                # sleep (the writer rings only after it sees the flag set).
                while True:
                    try:
                        self._bell.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            else:
                self._next_writer_check = 0.0  # a quiet half second: look at the writer now
            sleeping[me] = 0

    def _recv_side(self, timeout: float | None) -> list[Frame] | None:
        n = self._side_pending
        side = self._side
        assert n is not None and side is not None
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            now = time.monotonic()
            wait = _WAKE_S if deadline is None else max(0.0, min(_WAKE_S, deadline - now))
            if side.poll(int(wait * 1000 + 0.999), zmq.POLLIN):
                parts = side.recv_multipart(copy=False)
                got = _SEQ.unpack_from(parts[0].bytes, 1)[0]
                if got != n:
                    raise RingError(f"shm ring {self.name}: side channel delivered message {got}"
                                    f" while reader {self.index} expected {n}")
                self._side_pending = None
                return [part.buffer for part in parts[1:]]
            gone = self._writer_gone(force=True)
            # The writer sent this before publishing its marker; after a close it had the
            # linger time to deliver it, so a long silence means it is lost.
            if gone is RingWriterDied or (gone is RingClosed and now - start > 2.0):
                self._raise_gone(gone)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    # -- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Detach (never unlinks: the segment belongs to the writer).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._views is not None:
            self._views.readers[self.index * 8 + _R_STATE] = _STATE_CLOSED
        self._release()

    def _release(self) -> None:
        for sock in (self._bell, self._side):
            if sock is not None:
                sock.close()
        self._bell = self._side = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._views is not None:
            self._views.release()
            self._views = None
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
