"""The echo process of `tandem bench ipc`: it sends back what it is asked to, over the same
transport, counts one-way messages and reports its own CPU time while idle."""
from __future__ import annotations

import json
import time
from collections.abc import Callable

import zmq

from tandem_serve.ipc.shm_ring import RingReader, RingWriter

# Message kinds: first byte of frame 0.
ECHO, COUNT, TALLY, IDLE, IDLE_END, QUIT = b"E", b"T", b"C", b"I", b"J", b"Q"


def serve(recv: Callable[[float], bytes | None], send: Callable[[bytes], None]) -> None:
    """The echo loop both transports share: dispatch on the first byte."""
    counted = 0
    idle_start: tuple[float, float] | None = None
    while True:
        msg = recv(0.5)
        if msg is None:
            continue
        kind = msg[:1]
        if kind == ECHO:
            send(msg)
        elif kind == COUNT:
            counted += 1
        elif kind == TALLY:
            send(TALLY + str(counted).encode())
            counted = 0
        elif kind == IDLE:
            idle_start = (time.process_time(), time.monotonic())
        elif kind == IDLE_END and idle_start is not None:
            cpu = time.process_time() - idle_start[0]
            wall = time.monotonic() - idle_start[1]
            send(IDLE_END + json.dumps({"cpu_s": cpu, "wall_s": wall}).encode())
        elif kind == QUIT:
            return


def child_ring(name_in: str, name_out: str, addrs: list[str]) -> None:
    reader = RingReader(name_in, 0, addrs[0], addrs[1])
    writer = RingWriter(name_out, 1, addrs[2], addrs[3])
    try:
        writer.wait_ready(10.0)

        def recv(timeout: float) -> bytes | None:
            frames = reader.get_frames(timeout)
            return None if frames is None else bytes(frames[0])

        serve(recv, lambda msg: writer.put_frames([msg]))
    finally:
        writer.close()
        reader.close()


def child_zmq(addr_in: str, addr_out: str) -> None:
    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.connect(addr_in)
        push.connect(addr_out)

        def recv(timeout: float) -> bytes | None:
            if not pull.poll(int(timeout * 1000)):
                return None
            return pull.recv()

        serve(recv, push.send)
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()


def child_main(argv: list[str]) -> int:
    if argv[0] == "ring":
        child_ring(argv[1], argv[2], argv[3:7])
    else:
        child_zmq(argv[1], argv[2])
    return 0
