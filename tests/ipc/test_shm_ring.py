"""Shared-memory ring (ipc/shm_ring.py): in-process behaviour, then real processes.

Every test checks that its /dev/shm segments and ipc socket files are gone afterwards.
"""
from __future__ import annotations

import array
import itertools
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tandem_serve.ipc.shm_ring import (
    RingClosed,
    RingError,
    RingReader,
    RingReaderDied,
    RingWriter,
    RingWriterDied,
    pid_alive,
    unlink_ipc_file,
    unlink_segment,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_stress_child.py")
HEADER = struct.Struct("<QII")  # same as ring_stress_child.HEADER
_names = itertools.count()


@dataclass
class Env:
    """Names for one test, plus everything to reap and check when it ends."""

    ipc_dir: str
    names: list[str] = field(default_factory=list)
    children: list[subprocess.Popen[str]] = field(default_factory=list)

    def segment(self) -> str:
        name = f"tandem_{os.getpid()}_ringtest{next(_names)}"
        self.names.append(name)
        return name

    def addrs(self, tag: str) -> tuple[str, str]:
        return f"ipc://{self.ipc_dir}/{tag}_bell", f"ipc://{self.ipc_dir}/{tag}_side"

    def spawn(self, *args: object) -> subprocess.Popen[str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
        proc = subprocess.Popen([sys.executable, CHILD, *map(str, args)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.children.append(proc)
        return proc


@pytest.fixture
def env() -> Iterator[Env]:
    # Short path: ipc socket paths are limited to ~107 bytes.
    ipc_dir = tempfile.mkdtemp(prefix="tr_", dir="/tmp")
    e = Env(ipc_dir)
    try:
        yield e
    finally:
        for proc in e.children:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        leftover_shm = [n for n in e.names if os.path.exists(f"/dev/shm/{n}")]
        leftover_ipc = os.listdir(ipc_dir)
        for name in e.names:  # the crash cases rely on this, as the launcher will
            unlink_segment(name)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    assert not leftover_shm, f"segments left in /dev/shm: {leftover_shm}"
    assert not leftover_ipc, f"ipc socket files left: {leftover_ipc}"


def _report(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {err[-2000:]}"
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


# -- in-process ------------------------------------------------------------------------

def test_roundtrip_frames_side_channel_and_close(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("a")
    writer = RingWriter(name, 2, bell, side, slot_size=512, num_slots=8)
    readers = [RingReader(name, i, bell, side) for i in range(2)]
    writer.wait_ready(5.0)
    ints = array.array("I", range(20))  # a typed buffer, like a numpy frame from the codec
    messages: list[list[bytes]] = [
        [b"head", memoryview(ints).tobytes()],
        [],
        [b""],
        [b"big", os.urandom(3000)],  # larger than a slot: side channel
        [b"x" * 400],
    ]
    # Timeouts everywhere in-process: a bug must fail the test, not hang the suite.
    writer.put_frames([b"head", memoryview(ints)], timeout=5.0)
    for msg in messages[1:]:
        writer.put_frames(msg, timeout=5.0)
    for reader in readers:
        for msg in messages:
            got = reader.get_frames(1.0)
            assert got is not None and [bytes(f) for f in got] == msg
        start = time.monotonic()
        assert reader.get_frames(0.2) is None
        assert 0.15 < time.monotonic() - start < 1.0
    assert os.path.exists(f"/dev/shm/{name}")
    writer.close()
    writer.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    for reader in readers:
        with pytest.raises(RingClosed):
            reader.get_frames(1.0)
        reader.close()


def test_writer_blocks_when_full_and_times_out(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("a")
    with RingWriter(name, 1, bell, side, slot_size=256, num_slots=2) as writer:
        with RingReader(name, 0, bell, side) as reader:
            writer.wait_ready(5.0)
            writer.put_frames([b"1"], timeout=5.0)
            writer.put_frames([b"2"], timeout=5.0)
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=r"reader\(s\) \[0\]"):
                writer.put_frames([b"3"], timeout=0.3)
            assert time.monotonic() - start < 1.0
            assert reader.get_frames(1.0) == [b"1"]
            writer.put_frames([b"3"], timeout=1.0)  # the timed-out put left no trace
            assert reader.get_frames(1.0) == [b"2"]
            assert reader.get_frames(1.0) == [b"3"]


def test_backlog_counts_what_each_reader_has_not_read(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("a")
    with RingWriter(name, 2, bell, side, slot_size=256, num_slots=4) as writer:
        with RingReader(name, 0, bell, side) as r0, RingReader(name, 1, bell, side) as r1:
            writer.wait_ready(5.0)
            assert r0.backlog() == r1.backlog() == 0
            for i in range(3):
                writer.put_frames([b"%d" % i], timeout=5.0)
            assert r0.backlog() == r1.backlog() == 3
            assert r0.get_frames(1.0) == [b"0"]
            assert (r0.backlog(), r1.backlog()) == (2, 3)
            for _ in range(3):
                assert r1.get_frames(1.0) is not None
            writer.put_frames([b"3"], timeout=5.0)  # wraps round into slot 0
            writer.put_frames([b"4" * 600], timeout=5.0)  # side channel: still one message
            assert (r0.backlog(), r1.backlog()) == (4, 2)
            assert r1.get_frames(1.0) == [b"3"]
            assert r1.backlog() == 1
            assert r1.get_frames(1.0) is not None and r1.backlog() == 0


def test_wait_ready_times_out_when_a_reader_never_attaches(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("a")
    writer = RingWriter(name, 2, bell, side)
    reader = RingReader(name, 0, bell, side)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"reader\(s\) \[1\] of 2 did not attach"):
            writer.wait_ready(0.5)
        assert 0.45 < time.monotonic() - start < 1.5
    finally:
        reader.close()
        writer.close()


def test_without_a_deadline_readers_and_writer_wait_for_each_other(env: Env) -> None:
    """Start-up order and speed are the host's (a cold torch import can take longer than any
    fixed deadline): with None, a reader waits for a late writer and the writer for late
    readers, however long that takes."""
    name = env.segment()
    bell, side = env.addrs("late")
    got: list[RingReader] = []
    early = threading.Thread(target=lambda: got.append(
        RingReader(name, 0, bell, side, attach_timeout=None)))
    early.start()
    time.sleep(0.3)  # longer than the reader's old fixed wait would allow, scaled down
    assert early.is_alive()  # still waiting: no segment yet, and no deadline
    with RingWriter(name, 2, bell, side) as writer:
        early.join(10)
        assert got, "the early reader did not attach once the writer appeared"
        late: list[RingReader] = []
        threading.Timer(0.3, lambda: late.append(RingReader(name, 1, bell, side))).start()
        writer.wait_ready(None)  # returns when the late reader has attached
        assert late
        for r in got + late:
            r.close()


def test_reader_index_checks_and_attach_timeout(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("a")
    with pytest.raises(TimeoutError, match="no initialised segment"):
        RingReader(name, 0, bell, side, attach_timeout=0.1)
    with RingWriter(name, 1, bell, side):
        with pytest.raises(ValueError, match="out of range"):
            RingReader(name, 1, bell, side)
        with RingReader(name, 0, bell, side):
            with pytest.raises(RingError, match="already used"):
                RingReader(name, 0, bell, side)


def test_unlink_segment_is_idempotent(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("a")
    writer = RingWriter(name, 1, bell, side)
    unlink_segment(name)  # a launcher cleaning up after a crash, before the writer closes
    unlink_segment(name)
    assert not os.path.exists(f"/dev/shm/{name}")
    writer.close()  # must not fail on the missing name
    unlink_ipc_file(bell)  # likewise idempotent
    assert not os.listdir(env.ipc_dir)


# -- across processes ------------------------------------------------------------------

def _random_message(rng: random.Random, seq: int, pool: memoryview,
                    slot_size: int) -> list[bytes | memoryview]:
    payload: list[bytes | memoryview] = []
    for _ in range(rng.randrange(0, 4)):
        roll = rng.random()
        if roll < 0.02:
            length = rng.randrange(slot_size, 5 * slot_size)  # oversize: side channel
        elif roll < 0.15:
            length = rng.randrange(512, slot_size // 2)
        else:
            length = rng.randrange(0, 256)
        start = rng.randrange(0, len(pool) - length)
        payload.append(pool[start:start + length])
    if rng.random() < 0.05:  # a typed (non-byte) buffer, as the numpy codec produces
        payload.append(memoryview(array.array("I", range(rng.randrange(1, 64)))))
    crc = 0
    for frame in payload:
        crc = zlib.crc32(frame, crc)
    return [HEADER.pack(seq, len(payload), crc), *payload]


def test_stress_three_reader_processes(env: Env) -> None:
    """100k random messages (some oversize) to 3 reader processes: nothing lost, duplicated,
    reordered or corrupted; everything cleaned up."""
    total, readers, slot_size = 100_000, 3, 4096
    name = env.segment()
    bell, side = env.addrs("s")
    writer = RingWriter(name, readers, bell, side, slot_size=slot_size, num_slots=32)
    try:
        procs = [env.spawn("stress", name, i, bell, side) for i in range(readers)]
        writer.wait_ready(30.0)
        rng = random.Random(1234)
        pool = memoryview(os.urandom(1 << 20))
        digest = 0
        oversize = 0
        for seq in range(total):
            msg = _random_message(rng, seq, pool, slot_size)
            writer.put_frames(msg, timeout=20.0)
            digest = zlib.crc32(msg[0], digest)
            oversize += 4 + 4 * len(msg) + sum(len(memoryview(f).cast("B")) for f in msg) \
                > slot_size
        writer.put_frames([b"END"], timeout=20.0)
        reports = [_report(p, 60.0) for p in procs]
    finally:
        writer.close()
    assert oversize > 500
    for index, report in enumerate(reports):
        assert report["errors"] == [], f"reader {index}: {report['errors']}"
        assert report["ended"] and report["count"] == total, f"reader {index}: {report}"
        assert report["digest"] == digest, f"reader {index}: digest differs"
        assert report["side"] == oversize, f"reader {index}: {report['side']} != {oversize}"


def test_killed_reader_is_reported_within_2s(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("k")
    writer = RingWriter(name, 2, bell, side, slot_size=1024, num_slots=16)
    try:
        victim, survivor = (env.spawn("stress", name, i, bell, side) for i in range(2))
        writer.wait_ready(30.0)
        seq = 0
        kill_at = None
        start = time.monotonic()
        with pytest.raises(RingReaderDied) as died:
            while True:
                writer.put_frames([HEADER.pack(seq, 0, 0)], timeout=10.0)
                seq += 1
                if kill_at is None and time.monotonic() - start > 0.3:
                    # Not reaped until after the assertion: the writer must see the zombie.
                    victim.send_signal(signal.SIGKILL)
                    kill_at = time.monotonic()
                if seq % 64 == 0:
                    time.sleep(0.001)  # keep the stream steady rather than a burst
        detected = time.monotonic() - (kill_at or start)
    finally:
        writer.close()
    assert kill_at is not None
    assert died.value.reader_index == 0
    assert "reader 0" in str(died.value)
    assert detected < 2.0, f"took {detected:.2f} s"
    victim.wait(5.0)
    report = _report(survivor, 10.0)  # it saw RingClosed after the last message
    assert report["errors"] == [] and report["count"] == seq


def test_killed_writer_is_reported_within_2s(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("w")
    proc = env.spawn("writer", name, 1, bell, side, 5)
    reader = RingReader(name, 0, bell, side, attach_timeout=30.0)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "sent"
        for i in range(5):
            assert reader.get_frames(5.0) == [b"msg %d" % i]
        assert reader.get_frames(0.05) is None
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(RingWriterDied, match=r"writer \(pid \d+\) died"):
            while time.monotonic() - killed < 5.0:
                reader.get_frames(0.5)
        detected = time.monotonic() - killed
    finally:
        reader.close()
    assert detected < 2.0, f"took {detected:.2f} s"
    proc.wait(5.0)
    assert not pid_alive(proc.pid)
    # What the launcher does for a child that could not clean up after itself.
    unlink_segment(name)
    unlink_ipc_file(bell)
    unlink_ipc_file(side)


def test_idle_reader_does_not_spin(env: Env) -> None:
    name = env.segment()
    bell, side = env.addrs("i")
    seconds = 2.0
    with RingWriter(name, 1, bell, side) as writer:
        proc = env.spawn("idle", name, 0, bell, side, seconds)
        writer.wait_ready(30.0)
        report = _report(proc, 30.0)
    assert report["messages"] == 0
    assert report["wall_s"] >= seconds * 0.9
    assert report["cpu_s"] < 0.05 * report["wall_s"], report


def test_doorbell_wakes_sleeping_reader_quickly(env: Env) -> None:
    """A reader past its spin sleeps on the doorbell; a put must wake it at once, not after
    the 0.5 s safety wake-up."""
    name = env.segment()
    bell, side = env.addrs("d")
    with RingWriter(name, 1, bell, side) as writer, RingReader(name, 0, bell, side) as reader:
        writer.wait_ready(5.0)
        latencies: list[float] = []

        def put_later() -> None:
            for _ in range(5):
                time.sleep(0.05)  # long past the spin: the reader is asleep
                latencies.append(time.monotonic())
                writer.put_frames([b"ping"], timeout=5.0)

        thread = threading.Thread(target=put_later)
        thread.start()
        for i in range(5):
            assert reader.get_frames(5.0) == [b"ping"]
            latencies[i] = time.monotonic() - latencies[i]
        thread.join()
    assert max(latencies) < 0.2, latencies
