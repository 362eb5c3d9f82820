"""Child process for tests/ipc/test_shm_ring.py: a ring reader or writer in its own process.

    stress NAME INDEX BELL SIDE            read and verify until b"END"; print a JSON report
    idle NAME INDEX BELL SIDE SECONDS      attach, sit in get_frames, print the CPU it used
    writer NAME READERS BELL SIDE COUNT    create the ring, send COUNT messages, then block

Message format (stress): frame 0 = <seq u64, payload frame count u32, crc32 of payloads u32>,
then the payload frames.
"""
from __future__ import annotations

import json
import struct
import sys
import time
import zlib

from tandem_serve.ipc.shm_ring import RingClosed, RingReader, RingWriter

HEADER = struct.Struct("<QII")
END = b"END"


def payload_crc(frames: list[bytes | memoryview]) -> int:
    crc = 0
    for frame in frames:
        crc = zlib.crc32(frame, crc)
    return crc


def stress(name: str, index: int, bell: str, side: str) -> int:
    reader = RingReader(name, index, bell, side)
    expected = 0
    digest = 0
    side_messages = 0
    errors: list[str] = []
    ended = False
    try:
        while True:
            try:
                frames = reader.get_frames(5.0)
            except RingClosed:
                break
            if frames is None:
                errors.append(f"timed out waiting for message {expected}")
                break
            if bytes(frames[0]) == END:
                ended = True
                break
            seq, count, crc = HEADER.unpack(bytes(frames[0]))
            if isinstance(frames[-1], memoryview):
                side_messages += 1
            if seq != expected:
                errors.append(f"got message {seq}, expected {expected}")
            if count != len(frames) - 1:
                errors.append(f"message {seq}: {len(frames) - 1} frames, header says {count}")
            if payload_crc(frames[1:]) != crc:
                errors.append(f"message {seq}: crc mismatch")
            digest = zlib.crc32(frames[0], digest)
            expected = seq + 1
            if len(errors) > 10:
                break
    finally:
        reader.close()
    print(json.dumps({"count": expected, "digest": digest, "side": side_messages,
                      "ended": ended, "errors": errors}), flush=True)
    return 0


def idle(name: str, index: int, bell: str, side: str, seconds: float) -> int:
    reader = RingReader(name, index, bell, side)
    try:
        cpu0, wall0 = time.process_time(), time.monotonic()
        got = 0
        while (left := wall0 + seconds - time.monotonic()) > 0:
            if reader.get_frames(min(left, 0.5)) is not None:
                got += 1
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    finally:
        reader.close()
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "messages": got}), flush=True)
    return 0


def writer(name: str, readers: int, bell: str, side: str, count: int) -> int:
    ring = RingWriter(name, readers, bell, side, slot_size=1024, num_slots=8)
    ring.wait_ready(10.0)
    for i in range(count):
        ring.put_frames([b"msg %d" % i], timeout=10.0)
    print("sent", flush=True)
    time.sleep(3600)  # the test kills us here; close() must never run
    return 1


def main(argv: list[str]) -> int:
    mode, name = argv[0], argv[1]
    if mode == "stress":
        return stress(name, int(argv[2]), argv[3], argv[4])
    if mode == "idle":
        return idle(name, int(argv[2]), argv[3], argv[4], float(argv[5]))
    if mode == "writer":
        return writer(name, int(argv[2]), argv[3], argv[4], int(argv[5]))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
