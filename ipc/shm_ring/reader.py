"""One of the ring's N readers: attaches to the segment, copies messages out, sleeps on the
doorbell when idle.

See `ipc.shm_ring` for the protocol.
"""
from __future__ import annotations

import math
import mmap
import os
import time

import zmq

from tandem_serve.ipc.shm_ring.layout import (
    DEFAULT_SPIN_S,
    H_MAGIC,
    H_READERS,
    H_SLOT_SIZE,
    H_SLOTS,
    H_VERSION,
    H_WRITER_NS,
    H_WRITER_PID,
    H_WRITER_STATE,
    HEADS,
    LINE,
    LIVENESS_EVERY_S,
    MAGIC,
    R_NS,
    R_PID,
    R_STATE,
    SEQ,
    SIDE_MARKER,
    STATE_CLOSED,
    STATE_NONE,
    STATE_OPEN,
    U32,
    VERSION,
    WAKE_S,
    Frame,
    RingClosed,
    RingError,
    RingWriterDied,
    Views,
    full_fence,
    head_struct,
    open_untracked,
    pid_alive,
    pid_namespace,
    same_namespace,
    segment_layout,
)


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
                 attach_timeout: float | None = 10.0, spin_s: float = DEFAULT_SPIN_S) -> None:
        self.name = name
        self.index = reader_index
        self._spin_s = spin_s
        self._next = 1
        self._side_pending: int | None = None
        self._closed = False
        self._pid_ns = pid_namespace()
        self._next_writer_check = 0.0
        self._mm: mmap.mmap | None = None
        self._buf: memoryview | None = None
        self._views: Views | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._bell: zmq.Socket[bytes] | None = None
        self._side: zmq.Socket[bytes] | None = None
        try:
            self._attach(attach_timeout)
            self._connect(doorbell_addr, side_addr)
            assert self._views is not None
            line = self._views.readers
            line[reader_index * 8 + R_PID] = os.getpid()
            line[reader_index * 8 + R_NS] = self._pid_ns
            line[reader_index * 8 + R_STATE] = STATE_OPEN  # last: the writer counts this
        except BaseException:
            self._release()
            raise

    def _attach(self, attach_timeout: float | None) -> None:
        # The launcher may start readers before the writer has created the segment.
        # None: wait as long as it takes (a supervisor ends the wait if the writer dies).
        deadline = math.inf if attach_timeout is None else time.monotonic() + attach_timeout
        while True:
            try:
                mm = open_untracked(self.name)
                buf = memoryview(mm)
                if len(buf) >= LINE:
                    header = buf[:LINE].cast("q")
                    ok = header[H_MAGIC] == MAGIC
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
        if params[H_VERSION] != VERSION:
            raise RingError(f"shm ring {self.name}: layout version {params[H_VERSION]}, "
                            f"this reader speaks {VERSION}")
        self.num_readers = params[H_READERS]
        self.num_slots = params[H_SLOTS]
        self.slot_size = params[H_SLOT_SIZE]
        if not 0 <= self.index < self.num_readers:
            raise ValueError(f"shm ring {self.name}: reader_index {self.index} out of range "
                             f"0..{self.num_readers - 1}")
        if len(buf) < segment_layout(self.num_readers, self.num_slots, self.slot_size)[-1]:
            raise RingError(f"shm ring {self.name}: segment smaller than its header says")
        views = self._views = Views(buf, self.num_readers, self.num_slots)
        self._seqs, self._flags, self._data_off = views.seqs, views.flags, views.data_off
        line = self._views.readers
        state = line[self.index * 8 + R_STATE]
        if state != STATE_NONE:
            raise RingError(f"shm ring {self.name}: reader index {self.index} was already used "
                            f"(pid {line[self.index * 8 + R_PID]})")

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
        if header[H_WRITER_STATE] == STATE_CLOSED:
            return RingClosed
        now = time.monotonic()
        if not force and now < self._next_writer_check:
            return None
        self._next_writer_check = now + LIVENESS_EVERY_S
        if (same_namespace(self._pid_ns, header[H_WRITER_NS])
                and not pid_alive(header[H_WRITER_PID])):
            return RingWriterDied
        return None

    def _raise_gone(self, exc: type[RingError]) -> None:
        assert self._views is not None
        if exc is RingClosed:
            raise RingClosed(f"shm ring {self.name}: the writer closed the ring")
        pid = self._views.header[H_WRITER_PID]
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
        (count,) = U32.unpack_from(buf, off)
        if count == 1:
            (length,) = U32.unpack_from(buf, off + 4)
            if length > self.slot_size - 8:
                raise RingError(f"shm ring {self.name}: corrupt slot {slot} (length {length})")
            frames: list[Frame] = [buf[off + 8:off + 8 + length].tobytes()]
        elif count == SIDE_MARKER:
            self._flags[slot * LINE + self.index] = 1  # the slot only held the marker
            self._next = n + 1
            self._side_pending = n
            return self._recv_side(timeout)
        else:
            frames = self._copy_frames(buf, off, count, slot)
        # Every copy above is complete before this store is visible (see module docstring).
        self._flags[slot * LINE + self.index] = 1
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
        lengths = (HEADS.get(count) or head_struct(count)).unpack_from(buf, off)[1:]
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
            wait = WAKE_S if deadline is None else min(WAKE_S, deadline - now)
            sleeping[me] = 1
            full_fence()  # the re-check below must not be answered before the flag is visible
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
            wait = WAKE_S if deadline is None else max(0.0, min(WAKE_S, deadline - now))
            if side.poll(int(wait * 1000 + 0.999), zmq.POLLIN):
                parts = side.recv_multipart(copy=False)
                got = SEQ.unpack_from(parts[0].bytes, 1)[0]
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
            self._views.readers[self.index * 8 + R_STATE] = STATE_CLOSED
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
