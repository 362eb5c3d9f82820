"""The ring's one writer: creates the segment, publishes messages, wakes sleeping readers.

See `ipc.shm_ring` for the protocol.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import time
from collections.abc import Sequence
from multiprocessing import shared_memory

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
    MAX_READERS,
    MIN_SLOT_SIZE,
    R_NS,
    R_PID,
    R_STATE,
    SEQ,
    SIDE_LINGER_MS,
    SIDE_MARKER,
    STATE_CLOSED,
    STATE_OPEN,
    U32,
    VERSION,
    WAKE_S,
    Frame,
    RingError,
    RingReaderDied,
    Views,
    byte_view,
    fence_acquire,
    fence_release,
    head_struct,
    open_untracked,
    pid_alive,
    pid_namespace,
    round_up,
    same_namespace,
    segment_layout,
    unlink_ipc_file,
    unlink_segment,
)

log = logging.getLogger("ipc.shm_ring")


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
        self.slot_size = round_up(slot_size, LINE)
        self.doorbell_addr = doorbell_addr
        self.side_addr = side_addr
        self._spin_s = spin_s
        self._seq = 0
        self._closed = False
        self._pid_ns = pid_namespace()
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
        self._views: Views | None = None
        self._ctx = zmq.Context(io_threads=1)
        self._bell: zmq.Socket[bytes] | None = None
        self._side: zmq.Socket[bytes] | None = None
        self._next_reader_check = 0.0
        try:
            self._bell = self._bind(zmq.XPUB, doorbell_addr, linger=0)
            self._side = self._bind(zmq.XPUB, side_addr, linger=SIDE_LINGER_MS)
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
        _, _, _, _, _, total = segment_layout(self.num_readers, self.num_slots, self.slot_size)
        try:
            shm = shared_memory.SharedMemory(name=self.name, create=True, size=total)
        except FileExistsError:
            self._reclaim_stale_segment()
            shm = shared_memory.SharedMemory(name=self.name, create=True, size=total)
        self._shm = shm
        assert shm.buf is not None
        views = Views(shm.buf, self.num_readers, self.num_slots)
        self._views = views
        self._buf = shm.buf
        self._seqs = views.seqs
        self._flag_view = views.flag_words
        self._sleep_view = views.sleep_words
        self._data_off = views.data_off
        header = views.header
        header[H_VERSION] = VERSION
        header[H_READERS] = self.num_readers
        header[H_SLOTS] = self.num_slots
        header[H_SLOT_SIZE] = self.slot_size
        header[H_WRITER_PID] = os.getpid()
        header[H_WRITER_NS] = self._pid_ns
        header[H_WRITER_STATE] = STATE_OPEN
        header[H_MAGIC] = MAGIC  # last: readers treat the header as valid once they see it

    def _reclaim_stale_segment(self) -> None:
        """A segment with our name exists: take it over only if its writer is dead."""
        try:
            mm = open_untracked(self.name)
        except (FileNotFoundError, RingError):
            unlink_segment(self.name)
            return
        try:
            words = memoryview(mm)[:LINE].cast("q")
            valid, pid = words[H_MAGIC] == MAGIC, words[H_WRITER_PID]
            state = words[H_WRITER_STATE]
            words.release()
        finally:
            mm.close()
        if valid and state == STATE_OPEN and pid_alive(pid):
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
                if readers[i * 8 + R_STATE] != STATE_OPEN
                or i not in self._bell_seen or i not in self._side_seen]

    def wait_ready(self, timeout: float | None) -> None:
        """Return once every reader has attached and subscribed; TimeoutError after `timeout`
        seconds (None: as long as it takes; a reader that died is reported either way)."""
        self._check_open()
        assert self._bell is not None and self._side is not None
        deadline = math.inf if timeout is None else time.monotonic() + timeout
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
            state = readers[i * 8 + R_STATE]
            if state == STATE_CLOSED:
                raise RingReaderDied(i, "closed its end while the writer still needs it")
            if state == STATE_OPEN:
                pid = readers[i * 8 + R_PID]
                if (same_namespace(self._pid_ns, readers[i * 8 + R_NS])
                        and not pid_alive(pid)):
                    raise RingReaderDied(i, f"(pid {pid}) died")

    def _unread_by(self, slot: int) -> list[int]:
        assert self._views is not None
        flags = self._views.flags
        row = slot * LINE
        return [i for i in range(self.num_readers) if not flags[row + i]]

    # -- writing -------------------------------------------------------------------------

    def _slot_free(self, slot: int) -> bool:
        assert self._views is not None
        words = self._views.flag_words
        base = slot * (LINE // 8)
        for w, expected in self._all_read:
            if words[base + w] != expected:
                return False
        return True

    def _wait_slot_free(self, slot: int, deadline: float | None, timeout: float | None) -> None:
        start = time.monotonic()
        spin_end = start + self._spin_s
        next_check = start + LIVENESS_EVERY_S
        nap = 50e-6
        while not self._slot_free(slot):
            now = time.monotonic()
            if now >= next_check:
                self._check_readers(self._unread_by(slot))
                next_check = now + LIVENESS_EVERY_S
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
                next_check = now + LIVENESS_EVERY_S
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
        fbase = slot * (LINE // 8)
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        if now >= self._next_reader_check:  # a dead reader is an error even before it blocks us
            self._next_reader_check = now + WAKE_S
            self._check_readers(range(self.num_readers))
        if n > self.num_slots:
            for w, expected in self._all_read:
                if flag_words[fbase + w] != expected:
                    self._wait_slot_free(slot, deadline, timeout)
                    break

        parts = [f if type(f) is bytes else byte_view(f) for f in frames]
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
            packer = HEADS.get(count) or head_struct(count)
            packer.pack_into(buf, off, count, *[len(p) for p in parts])
            pos = off + head
            for part in parts:
                end = pos + len(part)
                buf[pos:end] = part
                pos = end
        else:
            # Sent before the marker is published, so it is queued by the time a reader
            # looks for it; PUB/SUB keeps per-connection order, so readers see n after n-1.
            assert self._side is not None
            self._side.send_multipart([b"S" + SEQ.pack(n), *parts], copy=True)
            U32.pack_into(buf, off, SIDE_MARKER)
        self._seqs[slot] = n  # publish
        self._seq = n
        fence_acquire()  # full fence, see module docstring (inlined full_fence)
        fence_release()
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
                self._views.header[H_WRITER_STATE] = STATE_CLOSED
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
