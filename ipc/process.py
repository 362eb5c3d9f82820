"""What every child process does first: name itself, die with its parent, log with its role.

Failure contract, child side (DESIGN.md section 5):
- SIGTERM becomes SystemExit, so `finally` blocks close sockets and unlink shm segments.
- The launcher's death, even by SIGKILL, sends SIGTERM (PR_SET_PDEATHSIG); a thread also
  watches the parent, and forces the exit when the main thread is stuck in a C call that
  never returns to the interpreter.  An orphaned child removes the launcher's run folder
  and the shm segments itself, since no one else is left to do it.
- A child dying of an exception tells the launcher why (`report_failure`), before the exits
  it causes in its peers (postproc workers leave when the gpu worker closes the ring) can
  be mistaken for the cause.
- A start-up mistake (`StartupError`: a model folder that cannot be served, a port in use)
  is the user's to fix, not a crash: it travels as one line, the traceback only to the log
  at debug level, and the server exits with status 2.
- SIGUSR1 dumps every thread's stack to stderr (the launcher's log), which the launcher
  asks for before it gives up on a hung worker.
"""
from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import time

from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.control_messages import ProcessFailed, WorkerHung

log = logging.getLogger("tandem.process")

# The command line every process of ours starts with: each role, a tensor-parallel rank
# and the benchmarks' servers run `tandem` under this interpreter.
CLI = (sys.executable, "-m", "tandem_serve.tandem.cli")


class StartupError(Exception):
    """The server cannot start as configured; the message names the flag and what it expects.

    `tandem` prints it as `tandem: error: <message>` and exits with status 2, like argparse
    does for a bad flag; a child that raises it reports it to the launcher, which does the same.
    """


class PeerDied(RuntimeError):
    """This process failed because a peer it works in lockstep with died or stopped answering
    (a tensor-parallel rank in a collective).  Reported as a consequence (`peer_died`), so
    the launcher blames the peer's own exit, which it usually hears about at the same time."""


_PR_SET_PDEATHSIG = 1
# How long an orphan's SIGTERM path may take before the watcher thread exits hard; long
# enough for a worker to finish the torch op it is in and run its `finally` blocks.
ORPHAN_GRACE_S = 3.0
PARENT_POLL_S = 0.5


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # optional nicety; ps then shows the python command line
        pass


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the launcher dies, even by SIGKILL (Linux); handlers then clean up."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def available_host_bytes() -> int:
    """Memory the host can still give without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        stream=sys.stderr, force=True)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks close sockets and unlink segments."""

    def handler(signum: int, frame: object) -> None:
        # Once: a second SIGTERM (PDEATHSIG plus the launcher's, say) must not cut short
        # the `finally` blocks the first one started.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides what Ctrl-C means


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every Python thread's stack to stderr, even mid C call (no GIL needed)."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def remove_run_files(run_dir: str, segments: tuple[str, ...]) -> None:
    """Remove the launcher's run folder and shm segments (idempotent, never raises)."""
    # Only a folder the launcher made: a hand-written config must not make us delete others.
    if run_dir and os.path.basename(run_dir.rstrip("/")).startswith("tandem-"):
        shutil.rmtree(run_dir, ignore_errors=True)
    for name in segments:
        if not name:
            continue
        try:
            from tandem_serve.ipc.shm_ring import unlink_segment

            unlink_segment(name)
        except Exception as exc:  # an exit path: report, never mask the real exit reason
            log.warning("could not unlink shm segment %s: %s", name, exc)


def orphaned(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def parent_exiting(parent_pid: int) -> bool:
    """Is the launcher gone or on its way out, even though `getppid()` still names it?

    PR_SET_PDEATHSIG fires when the *thread* that forked us exits.  When the launcher is
    killed, its main thread (which forked every child) can go first while its gRPC threads
    are still being torn down: we are then reparented to one of those threads, so
    `getppid()` is unchanged, and an exit that trusted it would leave the run folder behind.
    A leader thread that is a zombie, or a pending SIGKILL, tells the truth.
    """
    if orphaned(parent_pid):
        return True
    try:
        with open(f"/proc/{parent_pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
        return True
    pending = (int(fields.get(k, "0").strip() or "0", 16) for k in ("SigPnd", "ShdPnd"))
    return any(p & _SIGKILL_BIT for p in pending)


def _cleanup_if_orphaned(parent_pid: int, run_dir: str, segments: tuple[str, ...]) -> None:
    # Else the launcher is alive, and removes them once every child has exited.
    if parent_exiting(parent_pid):
        remove_run_files(run_dir, segments)


def _watch_parent(parent_pid: int, run_dir: str, segments: tuple[str, ...]) -> None:
    while not parent_exiting(parent_pid):
        time.sleep(PARENT_POLL_S)
    # PDEATHSIG has delivered SIGTERM already (Linux); elsewhere this is the only notice.
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
    time.sleep(ORPHAN_GRACE_S)
    # Still here: the main thread is stuck where SystemExit cannot reach it.
    log.error("launcher (pid %d) died and this process did not exit within %.0f s; "
              "exiting hard", parent_pid, ORPHAN_GRACE_S)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    remove_run_files(run_dir, segments)
    os._exit(1)


def exit_now(code: int) -> None:
    """End a child whose work and `finally` blocks are done: exit handlers (the orphan's
    run-folder cleanup) and log flushing, then `os._exit`.  The interpreter's own teardown
    (module by module, torch's included) costs the gpu worker half a second of CPU and adds
    nothing; on a loaded host that half second grows to seconds of every restart and stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving anyway: a second one is moot
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def report_failure(role: str, cfg: ServerConfig, exc: BaseException) -> None:
    """Send `ProcessFailed` to the launcher's supervision inbox; best effort, never raises."""
    if not cfg.addresses.supervisor:
        return
    try:
        import zmq

        from tandem_serve.ipc.channels import stamped
        from tandem_serve.ipc.shm_ring import RingReaderDied, RingWriterDied

        startup = isinstance(exc, StartupError)
        error = str(exc) if startup else f"{type(exc).__name__}: {exc}"[:300]
        msg = ProcessFailed(role, os.getpid(), error,
                            peer_died=isinstance(exc, (RingReaderDied, RingWriterDied,
                                                       PeerDied)),
                            startup=startup)
        # A private context: term() below returns once the message is out (or after the
        # linger), where the shared one would drop it at interpreter exit.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(cfg.addresses.supervisor)
        if sock.poll(500, zmq.POLLOUT):
            sock.send_multipart(stamped(msg))
        sock.close()
        ctx.term()
    except Exception as err:  # the original exception is what matters
        log.warning("could not report the failure to the launcher: %s", err)


# ---------------------------------------------------------------------- CPU placement


def _cuda_present() -> bool:
    """Cheap (no torch import): does this host expose an NVIDIA device?"""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


def split_cpus(cfg: ServerConfig) -> ServerConfig:
    """Where each process runs when the model runs on the CPU.

    The gpu worker gets every allowed core but `reserved_cpus`, one torch thread per core;
    the frontend, scheduler and postproc workers share the reserved ones.  Without this they
    preempt the worker's torch threads, and one preempted thread stalls every other at the
    next barrier of a parallel op: the forward slows by far more than the Python work
    costs, which is the opposite of overlap.  With an accelerator nothing is pinned.
    """
    if cfg.reserved_cpus == 0 or cfg.device == "cuda" or (cfg.device == "auto"
                                                          and _cuda_present()):
        return cfg
    cores = sorted(os.sched_getaffinity(0))
    reserved = cfg.reserved_cpus if cfg.reserved_cpus > 0 else 1
    if len(cores) <= reserved:
        if cfg.reserved_cpus > 0:
            log.warning("--reserved-cpus %d leaves no core for the gpu worker (%d allowed); "
                        "not pinning", reserved, len(cores))
        return cfg
    return cfg.replace(worker_cpus=tuple(cores[:-reserved]),
                       service_cpus=tuple(cores[-reserved:]))


def rank_cpus(cfg: ServerConfig, local_rank: int) -> tuple[int, ...]:
    """A gpu worker rank's share of `worker_cpus`: the cores split evenly between this node's
    ranks (a preempted thread of one rank would stall every rank at the next collective), or
    one core each, shared round-robin, when there are fewer cores than ranks."""
    cores, n = cfg.worker_cpus, cfg.ranks_per_node
    if n <= 1 or not cores:
        return cores
    if len(cores) < n:
        return (cores[local_rank % len(cores)],)
    per = len(cores) // n
    return cores[local_rank * per:(local_rank + 1) * per]


def worker_threads(cfg: ServerConfig, local_rank: int = 0) -> int:
    """The gpu worker rank's torch threads (0: torch's default): `--torch-threads`, else
    one per pinned core, else, with several ranks on the node, the cores split between them."""
    if cfg.torch_threads:
        return cfg.torch_threads
    pinned = rank_cpus(cfg, local_rank)
    if pinned:
        return len(pinned)
    if cfg.ranks_per_node > 1:
        return max(1, len(os.sched_getaffinity(0)) // cfg.ranks_per_node)
    return 0


def pin(role: str, cfg: ServerConfig, local_rank: int = 0) -> None:
    """Move this process onto its side of `split_cpus` (no-op when nothing was split)."""
    worker = role.startswith("gpu-worker")
    cpus = rank_cpus(cfg, local_rank) if worker else cfg.service_cpus
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # a cpuset changed under us: run unpinned rather than fail
        log.warning("could not pin %s to cores %s: %s", role, list(cpus), e)


def freeze_heap() -> None:
    """Once start-up is done: collect, then move every object left into the collector's
    permanent generation, so a full collection later walks only what serving allocated.

    A process of ours holds 30-65k objects after start-up (the imports, the tokenizer, the
    model); a full collection walks them all, 5-40 ms of CPU, and the process's cyclic
    collector runs one every several seconds of serving.  In a postproc worker that is a stall
    of every stream it owns, in the scheduler a late plan, in the frontend a stop of every
    stream (measured in the stall scenario served: full collections of 31-71 ms, mostly in the
    postproc workers; docs/BENCHMARKS.md).  Frozen, the same collection takes ~1 ms.
    """
    gc.collect()
    gc.freeze()


def init_child(role: str, cfg: ServerConfig, parent_pid: int | None,
               local_rank: int = 0) -> None:
    from tandem_serve.ipc import faults

    set_title(f"tandem: {role}")
    setup_logging(role, cfg.log_level)
    pin(role, cfg, local_rank)
    exit_on_sigterm()
    dump_stacks_on_sigusr1()
    faults.configure(cfg.fault)
    if parent_pid:
        segments = (cfg.addresses.ring_name,)
        atexit.register(_cleanup_if_orphaned, parent_pid, cfg.run_dir, segments)
        threading.Thread(target=_watch_parent, args=(parent_pid, cfg.run_dir, segments),
                         name="parent-watch", daemon=True).start()
        die_with_parent(parent_pid)


class PlanWatchdog:
    """Scheduler side of the hang watchdog: has the running plan taken longer than `timeout`?

    The worker runs plans in order, so the oldest unfinished plan has been running since
    the later of its sending and the previous plan's end: a plan queued behind a slow one
    is not blamed for it.  It reports once; the launcher then ends the server.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._sent: dict[int, float] = {}  # plan id -> time sent, in plan order
        self._head_since = 0.0
        self.reported = False

    def sent(self, plan_id: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self._sent:
            self._head_since = now
        self._sent[plan_id] = now

    def done(self, plan_id: int, now: float | None = None) -> None:
        if plan_id not in self._sent:
            return
        for older in [p for p in self._sent if p <= plan_id]:  # plans end in order
            del self._sent[older]
        self._head_since = time.monotonic() if now is None else now

    def check(self, now: float | None = None) -> WorkerHung | None:
        if self.reported or not self._sent or self.timeout <= 0:
            return None
        now = time.monotonic() if now is None else now
        head, sent = next(iter(self._sent.items()))
        running = now - max(self._head_since, sent)
        if running < self.timeout:
            return None
        self.reported = True
        return WorkerHung(head, running)
