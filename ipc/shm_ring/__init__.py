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
  between the two (`full_fence`: an uncontended lock acquire/release is a `lock cmpxchg`),
  which guarantees at least one side sees the other: no lost wake-up.
On weakly ordered CPUs (ARM) this module would need real acquire/release barriers.

Liveness.  Pids live in the header; `os.kill(pid, 0)` plus a zombie check in /proc tells a dead
peer (an unreaped child is a zombie that `kill(pid, 0)` still accepts).  Processes in different
pid namespaces cannot see each other's pids; the check is skipped then.
"""
from __future__ import annotations

from tandem_serve.ipc.shm_ring.layout import (
    DEFAULT_SPIN_S,
    MAX_READERS,
    Frame,
    RingClosed,
    RingError,
    RingReaderDied,
    RingWriterDied,
    pid_alive,
    unlink_ipc_file,
    unlink_segment,
)
from tandem_serve.ipc.shm_ring.reader import RingReader
from tandem_serve.ipc.shm_ring.writer import RingWriter

__all__ = [
    "DEFAULT_SPIN_S", "MAX_READERS", "Frame", "RingClosed", "RingError", "RingReader",
    "RingReaderDied", "RingWriter", "RingWriterDied", "pid_alive", "unlink_ipc_file",
    "unlink_segment",
]
