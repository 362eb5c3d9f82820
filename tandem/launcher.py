"""`tandem serve`: start the engine's processes and watch them, for the frontend process.

Start-up: make a private run folder for the ipc sockets, check what can be checked before
any process starts (tandem/preflight.py), then run the frontend process (tandem/serve.py)
in this one, which has the launcher start the scheduler, the gpu worker and N postproc
workers as separate OS processes once its ports are bound.

Supervision (DESIGN.md section 5): one thread per child waits for its exit, so a death is
seen at once, and the first crash is the one reported (a gpu worker dies soon after a
postproc worker it writes to; the postproc worker is the cause).  A child dying of an
exception says so first (`ProcessFailed`, with the error), ahead of the exits it causes.
The scheduler reports a plan that outlives `--step-timeout` (`WorkerHung`); the launcher
then has the worker dump its stacks to the log and treats it as dead.  Either way the
frontend hears what failed (`tandem.serve.Supervisor`) and fails every open request or,
for roles started on their own (`run-role frontend`, no children here), replaces their
set.  On every exit the children, sockets, run folder and shm segments are removed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem_serve.ipc import faults
from tandem_serve.ipc.channels import AsyncReceiver
from tandem_serve.ipc.process import CLI, StartupError, pin, split_cpus
from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.proto.control_messages import ProcessFailed, WorkerHung
from tandem_serve.tandem import serve as frontend_process
from tandem_serve.tandem.preflight import (
    adapter_store,
    check_host_memory,
    check_hybrid,
    check_model,
    check_pooling_model,
    load_tokenizer,
)
from tandem_serve.tandem.tp_node import free_local_addr

log = logging.getLogger("tandem.launcher")

# After a failure: how long children get for SIGTERM before SIGKILL.  Small, so the whole
# exit (detection, failing streams, gRPC stop, children) stays within a few seconds.
STOP_TIMEOUT_FAILED = 2.0
STOP_TIMEOUT_CLEAN = 5.0
CLEAN_EXIT_GRACE = 1.0  # see Launcher._child_exited
STACK_DUMP_WAIT = 0.5  # for a hung worker's faulthandler output to reach the log


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    exited_at: float | None = None  # time.monotonic(), set by the child's waiter thread

    def describe_exit(self) -> str:
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                how = f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"was killed by signal {-rc}"
        else:
            how = f"exited with code {rc}"
        return f"{self.role} process (pid {self.proc.pid}) {how}"


class Launcher:
    def __init__(self, cfg: ServerConfig) -> None:
        faults.parse(cfg.fault)  # a mistyped fault spec fails here, not silently later
        if cfg.standalone:  # `run-role frontend`: the peers run elsewhere, at given addresses
            self.run_dir = ""
            self.cfg = cfg
        else:
            self.run_dir = tempfile.mkdtemp(prefix=f"tandem-{os.getpid()}-")
            addr = Addresses.local(self.run_dir, _ring_tag(), cfg.num_postproc_workers,
                                   cfg.shm_ring)
            if cfg.tensor_parallel_size > 1 and not cfg.dist_init_addr:
                cfg = cfg.replace(dist_init_addr=free_local_addr())  # every rank is here
            self.cfg = split_cpus(cfg.replace(addresses=addr, run_dir=self.run_dir))
            pin("frontend", self.cfg)
        self.children: list[Child] = []
        self._failure: asyncio.Future[str] | None = None  # the first failure's message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reports: AsyncReceiver[object] | None = None  # the supervision inbox
        # Roles on their own: a failed process has its set replaced instead of ending it all.
        self._replace: Callable[[str], None] | None = None
        self._stopping = False  # children exit because we asked: not a failure
        self._cleaned = False
        self.startup_error: str | None = None  # a child's start-up mistake, said in one line
        self._consequences: set[str] = set()  # children that said a peer's death ended them

    # ------------------------------------------------------------------ for the frontend

    async def serve(self) -> int:
        """Check what can be checked, then run the frontend process; its exit status."""
        # Mistakes in the command line fail here, in one line, before any process starts.
        if self.cfg.node_rank > 0:
            raise StartupError(f"--node-rank {self.cfg.node_rank}: the frontend and rank 0 run "
                               f"on node 0; start this host's ranks with `tandem run-role "
                               f"gpu-worker --node-rank {self.cfg.node_rank} ...`")
        if self.cfg.runner == "pooling":  # embeddings, rerank, score (no adapters)
            check_pooling_model(self.cfg.model)
            adapters = None
        else:
            config = check_model(self.cfg.model, self.cfg.tensor_parallel_size)
            check_hybrid(self.cfg, config)
            adapters = adapter_store(self.cfg, config)
        check_host_memory(self.cfg)
        tok = load_tokenizer(self.cfg.model)
        return await frontend_process.serve(self.cfg, self, tok, adapters)

    def start(self) -> asyncio.Future[str]:
        """Start the children and watch their exits (`tandem.serve.Supervisor`)."""
        self._loop = asyncio.get_running_loop()
        self._failure = self._loop.create_future()
        if self.cfg.addresses.supervisor:
            self._reports = AsyncReceiver(self.cfg.addresses.supervisor, bind=True)
        self.start_children()
        return self._failure

    def stop(self, failed: bool) -> None:
        if self._reports is not None:
            self._reports.close()
            self._reports = None
        self.cleanup(STOP_TIMEOUT_FAILED if failed else STOP_TIMEOUT_CLEAN)

    # ------------------------------------------------------------------ children

    def start_children(self) -> None:
        if self.cfg.standalone:
            return
        path = os.path.join(self.run_dir, "config.json")
        with open(path, "w") as f:
            # The API key is the frontend's alone: no file of ours holds it.
            f.write(self.cfg.replace(api_key="").to_json())
        # Tensor parallelism: this host's gpu worker ranks, each a child like any other.
        roles = [("scheduler", 0)] + [("gpu-worker", r) for r in self.cfg.node_ranks()] + [
            ("postproc", i) for i in range(self.cfg.num_postproc_workers)
            if self.cfg.runner != "pooling"]  # pooling outputs are vectors: no postproc
        for role, index in roles:
            cmd = [*CLI, "run-role", role, "--config-file", path,
                   "--index", str(index), "--parent-pid", str(os.getpid())]
            # From the main thread: PR_SET_PDEATHSIG fires when the creating *thread* exits.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            name = {"postproc": f"postproc {index}",
                    "gpu-worker": self.cfg.worker_role(index)}.get(role, role)
            child = Child(name, proc)
            self.children.append(child)
            threading.Thread(target=self._wait_child, args=(child,), name=f"wait-{name}",
                             daemon=True).start()
            log.info("started %s (pid %d)", name, proc.pid)

    def _wait_child(self, child: Child) -> None:
        child.proc.wait()
        child.exited_at = time.monotonic()
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._child_exited, child)
        except RuntimeError:  # the loop is closed: we are exiting anyway
            pass

    def _child_exited(self, child: Child) -> None:
        if self._stopping:
            return
        rc = child.proc.returncode
        # Status 2 is a start-up mistake, which the user sees in one line of its own.
        log.log(logging.DEBUG if rc == 2 else logging.WARNING, "%s", child.describe_exit())
        # A signal (SIGKILL, a crash) is a cause: blame at once.  An exit status is often a
        # consequence: postproc workers leave when the gpu worker dies or closes the ring,
        # and under load a consequence can be reaped before its cause (each child's waiter
        # thread runs when the scheduler lets it), so the cause gets a moment to be seen.
        # A child dying of an exception says why first (`ProcessFailed`), which fails at once.
        if rc is not None and rc >= 0 and self._loop is not None:
            self._loop.call_later(CLEAN_EXIT_GRACE, self._blame)
            return
        self._blame()

    def _blame(self) -> None:
        """Fail with the child that caused it: killed by a signal, else crashed without
        saying a peer's death made it, else crashed, else exited at all; the first of them."""
        dead = [c for c in self.children if c.exited_at is not None]
        crashed = [c for c in dead if c.proc.returncode != 0]
        killed = [c for c in crashed if (c.proc.returncode or 0) < 0]
        causes = [c for c in crashed if c.role not in self._consequences]
        pick = killed or causes or crashed or dead
        if pick:
            self._fail(min(pick, key=lambda c: c.exited_at or 0.0).describe_exit())

    def _fail(self, message: str) -> None:
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(message)

    def role_children(self, role: str) -> list[Child]:
        """The children of a role: every gpu worker rank for "gpu-worker"."""
        return [c for c in self.children if c.role == role or c.role.startswith(role + " ")]

    def stop_children(self, timeout: float = STOP_TIMEOUT_CLEAN) -> None:
        """SIGTERM every child (their handlers close sockets and unlink segments), then
        SIGKILL whoever is still there after `timeout` - with its stacks in the log first."""
        self._stopping = True
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + timeout
        for c in self.children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop within %.1f s; killing it", c.role,
                            c.proc.pid, timeout)
                if _dump_stacks(c):
                    time.sleep(0.2)  # for faulthandler to write it
                c.proc.kill()
                c.proc.wait()

    def cleanup(self, timeout: float = STOP_TIMEOUT_CLEAN) -> None:
        """Stop every child and remove the run folder and shm segments (idempotent)."""
        if self._cleaned:
            return
        self._cleaned = True
        self.stop_children(timeout)
        # A child killed by SIGKILL could not remove its own segment or socket files.
        if self.cfg.addresses.ring_name:
            from tandem_serve.ipc.shm_ring import unlink_segment

            unlink_segment(self.cfg.addresses.ring_name)
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ failures

    async def watch(self, replace: Callable[[str], None] | None) -> None:
        """Read the children's reports until cancelled (`tandem.serve.Supervisor`)."""
        self._replace = replace
        reports = self._reports
        if reports is None:
            return
        while True:
            msg = await reports.get()
            if isinstance(msg, WorkerHung):
                await self._on_hung(msg)
            elif isinstance(msg, ProcessFailed):
                text = f"{msg.role} process (pid {msg.pid}) failed: {msg.error}"
                if msg.startup and self.startup_error is None:
                    log.debug("%s", text)
                    self.startup_error = msg.error
                    self._fail(text)
                elif self._stopping or (self._failure is not None and self._failure.done()):
                    log.warning("%s", text)  # a consequence of the first failure, most likely
                elif msg.peer_died and self._loop is not None:
                    self._consequences.add(msg.role)
                    # The dead peer's own exit names the cause; this report can outrun it.
                    log.warning("%s", text)
                    self._loop.call_later(CLEAN_EXIT_GRACE, self._lose, text)
                else:
                    self._lose(text)
            else:
                log.error("unexpected supervision message %s", type(msg).__name__)

    async def _on_hung(self, msg: WorkerHung) -> None:
        # Under tensor parallelism one stuck rank stalls all of them: dump every rank.
        children = self.role_children(msg.role)
        pid = children[0].proc.pid if children else -1
        log.error("%s (pid %d) looks hung: plan %d has not finished after %.1f s "
                  "(--step-timeout %g s); its stacks follow", msg.role, pid, msg.plan_id,
                  msg.seconds, self.cfg.step_timeout)
        # One rank at a time: faulthandler writes in small pieces, and two ranks dumping
        # into the shared log at once interleave into lines no one can read.
        for c in children:
            if _dump_stacks(c):
                await asyncio.sleep(STACK_DUMP_WAIT)
        self._lose(f"{msg.role} process (pid {pid}) hung: plan {msg.plan_id} did not finish "
                   f"within the {self.cfg.step_timeout:g} s step timeout")

    def _lose(self, message: str) -> None:
        """A process failed: under the launcher the server ends; roles on their own replace
        their set and the frontend stays (frontend/standalone.py)."""
        if self._replace is not None:
            self._replace(message)
        else:
            self._fail(message)


_launchers = itertools.count()


def _ring_tag() -> str:
    """The pid, and after the first launcher of a process a count: the offline API may run
    several engines in one process, each with a ring of its own."""
    n = next(_launchers)
    return f"{os.getpid()}" if n == 0 else f"{os.getpid()}_{n}"


def _dump_stacks(child: Child) -> bool:
    """Ask a child for its stacks (faulthandler on SIGUSR1 writes them to the shared log)."""
    if child.exited_at is not None:  # reaped: its pid may belong to someone else now
        return False
    try:
        os.kill(child.proc.pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def serve(cfg: ServerConfig) -> int:
    """Serve until a signal or a failure; a start-up mistake raises StartupError."""
    launcher = Launcher(cfg)
    try:
        code = asyncio.run(launcher.serve())
    finally:
        launcher.cleanup()
    if launcher.startup_error is not None:
        raise StartupError(launcher.startup_error)
    return code
