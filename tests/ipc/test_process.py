"""Child-process plumbing: parent-death exit and cleanup, stack dumps, the hang watchdog and
fault injection.  The process tests use a throwaway parent so that it, not the test runner,
can be killed."""
from __future__ import annotations

import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tandem_serve.ipc import faults
from tandem_serve.ipc.process import ORPHAN_GRACE_S, PlanWatchdog, remove_run_files

ROOT = str(pathlib.Path(__file__).resolve().parents[2])

CHILD = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[5])
from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.ipc.process import init_child
run_dir, segment, mode, parent = sys.argv[1:5]
cfg = ServerConfig(model="", run_dir=run_dir, log_level="WARNING",
                   addresses=Addresses("", "", "", (), "", ring_name=segment))
init_child("test-child", cfg, int(parent))
if mode == "torch":
    import torch
    a = torch.randn(256, 256)
print("ready", flush=True)
if mode == "zmq":  # blocked in zmq_poll with no timeout
    from tandem_serve.ipc.channels import Receiver
    Receiver(f"ipc://{run_dir}/inbox").get(timeout=None)
elif mode == "torch":  # busy in torch ops
    while True:
        a = (a @ a).tanh()
elif mode == "stuck":  # SystemExit never reaches the main thread
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(0.1)
else:
    while True:
        time.sleep(0.1)
"""

# argv: CHILD run_dir segment mode root; the child gets its parent's pid before root.
PARENT = r"""
import os, subprocess, sys
run_dir, segment, mode, root = sys.argv[2:6]
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], run_dir, segment, mode,
                          str(os.getpid()), root])
print(child.pid, flush=True)
if mode == "leader-exit":  # on "go", only the main thread exits; another lives on a while
    import ctypes, platform, threading, time
    sys.stdin.readline()
    threading.Thread(target=lambda: (time.sleep(5), os._exit(0))).start()
    SYS_EXIT = {"x86_64": 60, "aarch64": 93}[platform.machine()]
    ctypes.CDLL(None).syscall(SYS_EXIT, 0)
sys.exit(child.wait())  # a child that fails to start closes the pipe: no hung test
"""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_family(mode: str, tmp: pathlib.Path) -> tuple[subprocess.Popen, int, str, str]:
    run_dir = tempfile.mkdtemp(prefix="tandem-test-", dir=tmp)
    (pathlib.Path(run_dir) / "frontend").write_text("a socket file stand-in")
    segment = f"tandem_test{os.getpid()}_{mode}"
    pathlib.Path(f"/dev/shm/{segment}").write_bytes(b"x")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, run_dir, segment, mode, ROOT],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready", "child failed to start"  # shared pipe
    return parent, child, run_dir, segment


def wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    while pid_alive(pid):
        if time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"child {pid} still alive {timeout} s after its parent died")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("mode", ["sleep", "zmq", "torch"])
def test_child_exits_and_cleans_up_when_parent_is_killed(tmp_path: pathlib.Path,
                                                         mode: str) -> None:
    parent, child, run_dir, segment = start_family(mode, tmp_path)
    try:
        parent.kill()
        parent.wait()
        assert wait_gone(child, 2.0) < 2.0
        assert not os.path.exists(run_dir)
        assert not os.path.exists(f"/dev/shm/{segment}")
    finally:
        remove_run_files(run_dir, (segment,))  # whatever a failed run left


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64") or
                    not sys.platform.startswith("linux"), reason="raw SYS_exit needs Linux")
def test_child_cleans_up_when_launcher_main_thread_dies_first(tmp_path: pathlib.Path) -> None:
    """A killed launcher's main thread can exit before its other threads: PDEATHSIG arrives
    while getppid() still names the launcher, which must not stop the cleanup."""
    parent, child, run_dir, segment = start_family("leader-exit", tmp_path)
    try:
        assert parent.stdin is not None
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert wait_gone(child, 2.0) < 2.0
        assert parent.poll() is None  # the launcher's last thread is still there...
        assert not os.path.exists(run_dir)  # ...and yet the child cleaned up
        assert not os.path.exists(f"/dev/shm/{segment}")
    finally:
        parent.kill()
        parent.wait()
        remove_run_files(run_dir, (segment,))


def test_stuck_child_is_forced_out(tmp_path: pathlib.Path) -> None:
    parent, child, run_dir, segment = start_family("stuck", tmp_path)
    try:
        parent.kill()
        parent.wait()
        wait_gone(child, ORPHAN_GRACE_S + 3.0)
        assert not os.path.exists(run_dir)
        assert not os.path.exists(f"/dev/shm/{segment}")
    finally:
        remove_run_files(run_dir, (segment,))


def test_sigusr1_dumps_every_thread(tmp_path: pathlib.Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="tandem-test-", dir=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, run_dir, "", "sleep", str(os.getpid()),
                             ROOT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None  # a dump, not a death
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert "most recent call first" in err
    # The other thread is in the dump too (its frames: _watch_parent, or what it calls when
    # the signal lands; faulthandler names the innermost frame first).
    assert "Current thread" in err and err.count("\nThread 0x") + err.startswith("Thread 0x") >= 1
    assert os.path.exists(run_dir)  # our parent is alive: the run folder is not ours to remove


def test_remove_run_files_only_touches_tandem_folders(tmp_path: pathlib.Path) -> None:
    other = tmp_path / "precious"
    other.mkdir()
    remove_run_files(str(other), ())
    assert other.exists()
    ours = tmp_path / "tandem-123-abc"
    ours.mkdir()
    (ours / "scheduler").write_text("")
    remove_run_files(str(ours), ("tandem_no_such_segment",))
    assert not ours.exists()


# ---------------------------------------------------------------------- watchdog


def test_watchdog_blames_the_running_plan_not_the_queued_one() -> None:
    w = PlanWatchdog(timeout=10.0)
    assert w.check(now=0.0) is None
    w.sent(0, now=0.0)
    w.sent(1, now=0.1)  # queued behind plan 0
    assert w.check(now=9.9) is None
    w.done(0, now=9.0)  # plan 1 starts running only now
    assert w.check(now=18.9) is None
    hung = w.check(now=19.5)
    assert hung is not None and hung.plan_id == 1 and hung.seconds == pytest.approx(10.5)
    assert w.check(now=100.0) is None  # reported once


def test_watchdog_idle_and_out_of_order_done() -> None:
    w = PlanWatchdog(timeout=1.0)
    w.sent(0, now=0.0)
    w.sent(1, now=0.0)
    w.done(1, now=0.5)  # a later plan's end means the earlier ones ended too
    assert w.check(now=100.0) is None
    w.sent(2, now=200.0)  # the idle time before it does not count
    assert w.check(now=200.5) is None
    assert w.check(now=201.5) is not None
    assert PlanWatchdog(timeout=0).check() is None  # 0: off


# ---------------------------------------------------------------------- faults


def test_fault_spec_parsing() -> None:
    got = faults.parse("gpu-worker:plan=5:raise, postproc 0:plan=4:exit,scheduler:plan=3:hang")
    assert [(f.role, f.plan, f.action) for f in got] == [
        ("gpuworker", 5, "raise"), ("postproc0", 4, "exit"), ("scheduler", 3, "hang")]
    assert faults.parse("") == []
    for bad in ["gpu-worker:5:raise", "gpu-worker:plan=x:raise", "gpu-worker:plan=5:explode"]:
        with pytest.raises(ValueError):
            faults.parse(bad)


def test_fault_fires_once_at_or_after_its_plan() -> None:
    faults.configure("postproc1:plan=4:raise")
    try:
        faults.maybe_fire("postproc 1", 3)
        faults.maybe_fire("postproc 0", 9)  # another process's role
        faults.maybe_fire("scheduler", 9)
        with pytest.raises(faults.InjectedFault):
            faults.maybe_fire("postproc-1", 6)  # plan 4 and 5 were never seen here
        faults.maybe_fire("postproc 1", 7)
    finally:
        faults.configure("")


# ---------------------------------------------------------------------- resource hygiene


def test_slow_reader_deltas_merge_instead_of_piling_up(tmp_path: pathlib.Path) -> None:
    """The frontend's per-request queue stays short when the client does not read."""
    import asyncio

    from tandem_serve.frontend.engine_client import EngineClient, OpenStream
    from tandem_serve.frontend.stream_buffer import StreamBuffer
    from tandem_serve.proto.config import Addresses, ServerConfig
    from tandem_serve.proto.request_params import FinishReason
    from tandem_serve.proto.token_messages import OutputDelta

    async def main() -> list[object]:
        cfg = ServerConfig(model="", addresses=Addresses.local(str(tmp_path), "t", 1, False))
        engine = EngineClient(cfg)
        try:
            buf = StreamBuffer(limit=0)
            queue = buf.queue
            engine._streams[7] = OpenStream(buf, time.monotonic())
            for i in range(1000):
                engine._route(7, OutputDelta(7, f"t{i} ", i + 1, token_ids=[i],
                                             logprobs=[-float(i)]))
            engine._route(7, OutputDelta(7, "end", 1001, token_ids=[1000], logprobs=[0.0],
                                         finish_reason=FinishReason.MAX_TOKENS))
            engine.fail_all("gone")  # still reaches the stream behind a merged backlog
            assert queue.qsize() <= 18
            return [queue.get_nowait() for _ in range(queue.qsize())]
        finally:
            engine.close()

    items = asyncio.run(main())
    deltas = [d for d in items if isinstance(d, OutputDelta)]
    assert "".join(d.text for d in deltas) == "".join(f"t{i} " for i in range(1000)) + "end"
    assert [t for d in deltas for t in d.token_ids] == list(range(1001))
    assert [x for d in deltas for x in d.logprobs or []][:3] == [0.0, -1.0, -2.0]
    assert deltas[-1].num_generated == 1001
    assert deltas[-1].finish_reason == FinishReason.MAX_TOKENS
    assert type(items[-1]).__name__ == "EngineError"


# ---------------------------------------------------------------------- CPU placement


def _placement(monkeypatch: pytest.MonkeyPatch, cores: set[int], cuda: bool = False,
               **cfg: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from tandem_serve.ipc import process
    from tandem_serve.proto.config import ServerConfig

    monkeypatch.setattr(process.os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(process, "_cuda_present", lambda: cuda)
    out = process.split_cpus(ServerConfig(model="", **cfg))  # type: ignore[arg-type]
    return out.worker_cpus, out.service_cpus


def test_cpu_device_keeps_one_core_for_the_python_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _placement(monkeypatch, {0, 1}) == ((0,), (1,))
    assert _placement(monkeypatch, {2, 5, 7, 9}) == ((2, 5, 7), (9,))
    assert _placement(monkeypatch, {0, 1, 2, 3}, reserved_cpus=2) == ((0, 1), (2, 3))


def test_nothing_is_pinned_with_an_accelerator_one_core_or_when_disabled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _placement(monkeypatch, {0, 1}, cuda=True) == ((), ())
    assert _placement(monkeypatch, {0, 1}, device="cuda") == ((), ())
    assert _placement(monkeypatch, {0}) == ((), ())
    assert _placement(monkeypatch, {0, 1}, reserved_cpus=0) == ((), ())
    assert _placement(monkeypatch, {0, 1}, reserved_cpus=2) == ((), ())
    # An explicit CPU device is pinned even on a host with a GPU.
    assert _placement(monkeypatch, {0, 1}, cuda=True, device="cpu") == ((0,), (1,))


def test_placement_survives_the_config_file_round_trip() -> None:
    from tandem_serve.proto.config import ServerConfig

    cfg = ServerConfig(model="m", worker_cpus=(0, 1), service_cpus=(2,))
    assert ServerConfig.from_json(cfg.to_json()) == cfg


def test_tensor_parallel_ranks_split_the_worker_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank gets its own cores (a preempted rank stalls every rank at the next
    collective), one torch thread per core; fewer cores than ranks: one core each, shared."""
    from tandem_serve.ipc import process
    from tandem_serve.proto.config import ServerConfig

    monkeypatch.setattr(process.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})

    def cfg(cores: tuple[int, ...], tp: int, **kw: object) -> ServerConfig:
        return ServerConfig(model="", worker_cpus=cores, tensor_parallel_size=tp,
                            **kw)  # type: ignore[arg-type]

    seven = cfg((0, 1, 2, 3, 4, 5, 6), 2)
    assert [process.rank_cpus(seven, r) for r in (0, 1)] == [(0, 1, 2), (3, 4, 5)]
    assert [process.worker_threads(seven, r) for r in (0, 1)] == [3, 3]
    one = cfg((0,), 2)
    assert [process.rank_cpus(one, r) for r in (0, 1)] == [(0,), (0,)]
    three = cfg((0, 1, 2), 4)
    assert [process.rank_cpus(three, r) for r in range(4)] == [(0,), (1,), (2,), (0,)]
    # Two hosts: each pins its own ranks (local rank 0 and 1 of this node).
    assert process.rank_cpus(cfg((0, 1, 2, 3), 4, nnodes=2, dist_init_addr="h:1"), 1) == (2, 3)
    # Not pinned (--reserved-cpus 0): the host's cores split between its ranks.
    assert process.worker_threads(cfg((), 2), 0) == 4
    assert process.worker_threads(cfg((), 2, torch_threads=1), 0) == 1
    assert process.worker_threads(cfg((), 1), 0) == 0  # one rank: torch's default
    assert process.rank_cpus(cfg((4, 5), 1), 0) == (4, 5)
