"""`tandem serve`: the frontend process, which starts and watches every other process.

Start-up: make a private run folder for the ipc sockets, start the scheduler, the gpu
worker and N postproc workers as separate OS processes, serve gRPC and (`--http-port`) the
OpenAI-compatible HTTP API on the same event loop and engine client, and turn readiness on
once every process has reported in and a warm-up request has gone through.

Supervision (DESIGN.md section 5): one thread per child waits for its exit, so a death is
seen at once, and the first crash is the one reported (a gpu worker dies soon after a
postproc worker it writes to; the postproc worker is the cause).  A child dying of an
exception says so first (`ProcessFailed`, with the error), ahead of the exits it causes.
The scheduler reports a plan that outlives `--step-timeout` (`WorkerHung`); the launcher
then has the worker dump its stacks to the log and treats it as dead.  Either way: health
NOT_SERVING, every open stream ends with UNAVAILABLE naming the process, the rest are
stopped, exit code 1.  A frontend of roles started on their own (`run-role frontend`)
replaces their set instead and keeps serving (tandem/standalone.py).
SIGTERM/SIGINT: NOT_SERVING (HTTP /health 503) at once, new requests get UNAVAILABLE (HTTP
503), in-flight ones finish
up to `--shutdown-timeout`, exit 0; a second signal exits at once.  On every exit the
children, sockets, run folder and shm segments are removed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from grpc_health.v1 import health_pb2

from tandem_serve.frontend import guided
from tandem_serve.frontend.engine_client import EngineClient
from tandem_serve.frontend.frontend import Frontend
from tandem_serve.frontend.metrics import serve_metrics
from tandem_serve.frontend.validation import Limits
from tandem_serve.guided.service import GuidedCompiler
from tandem_serve.ipc import faults
from tandem_serve.ipc.channels import AsyncReceiver
from tandem_serve.ipc.process import CLI, StartupError, pin, split_cpus
from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.proto.messages import OutputOptions, ProcessFailed, SamplingParams, WorkerHung
from tandem_serve.rpc.server import SERVICE_NAME
from tandem_serve.tandem.grpc_server import add_services, bound_grpc_server, set_health
from tandem_serve.tandem.preflight import (
    adapter_store,
    bound_socket,
    check_model,
    check_ports,
    load_tokenizer,
)
from tandem_serve.tandem.standalone import SetKeeper
from tandem_serve.tandem.tp_node import free_local_addr
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.launcher")

# After a failure: how long children get for SIGTERM before SIGKILL.  Small, so the whole
# exit (detection, failing streams, gRPC stop, children) stays within a few seconds.
STOP_TIMEOUT_FAILED = 2.0
STOP_TIMEOUT_CLEAN = 5.0
CLEAN_EXIT_GRACE = 1.0  # see Launcher._child_exited
STACK_DUMP_WAIT = 0.5  # for a hung worker's faulthandler output to reach the log
FLUSH_WAIT = 1.0  # for failed streams to send their status before the gRPC server stops
GRPC_STOP_GRACE = 1.0


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
            addr = Addresses.local(self.run_dir, str(os.getpid()), cfg.num_postproc_workers,
                                   cfg.shm_ring)
            if cfg.tensor_parallel_size > 1 and not cfg.dist_init_addr:
                cfg = cfg.replace(dist_init_addr=free_local_addr())  # every rank is here
            self.cfg = split_cpus(cfg.replace(addresses=addr, run_dir=self.run_dir))
            pin("frontend", self.cfg)
        self.children: list[Child] = []
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._failure: asyncio.Future[str] | None = None  # the first failure's message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._stopping = False  # children exit because we asked: not a failure
        self._cleaned = False
        self.startup_error: str | None = None  # a child's start-up mistake, said in one line
        self._precompile: asyncio.Task[None] | None = None  # format=JSON, after readiness
        self.keeper: SetKeeper | None = None  # roles on their own: the set they serve as
        self._consequences: set[str] = set()  # children that said a peer's death ended them

    # ------------------------------------------------------------------ children

    def start_children(self) -> None:
        if self.cfg.standalone:
            return
        path = os.path.join(self.run_dir, "config.json")
        with open(path, "w") as f:
            f.write(self.cfg.to_json())
        # Tensor parallelism: this host's gpu worker ranks, each a child like any other.
        roles = [("scheduler", 0)] + [("gpu-worker", r) for r in self.cfg.node_ranks()] + [
            ("postproc", i) for i in range(self.cfg.num_postproc_workers)]
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

    # ------------------------------------------------------------------ serving

    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._failure = self._loop.create_future()
        # Mistakes in the command line fail here, in one line, before any process starts.
        if self.cfg.node_rank > 0:
            raise StartupError(f"--node-rank {self.cfg.node_rank}: the frontend and rank 0 run "
                               f"on node 0; start this host's ranks with `tandem run-role "
                               f"gpu-worker --node-rank {self.cfg.node_rank} ...`")
        config = check_model(self.cfg.model, self.cfg.tensor_parallel_size)
        adapters = adapter_store(self.cfg, config)
        tok = load_tokenizer(self.cfg.model)
        check_ports(self.cfg)
        server = bound_grpc_server(self.cfg)
        http_sock = bound_socket("--http-port", self.cfg.host, self.cfg.http_port) \
            if self.cfg.http_port else None
        engine = EngineClient(self.cfg)
        engine.start()
        frontend = Frontend(engine, tok, adapters)
        reports: AsyncReceiver[object] | None = (
            AsyncReceiver(self.cfg.addresses.supervisor, bind=True)
            if self.cfg.addresses.supervisor else None)
        self.start_children()
        health_servicer = add_services(server, frontend)
        await server.start()
        http = None
        if http_sock is not None:
            from tandem_serve.openai_api.server import create_http_server

            http = create_http_server(self.cfg, frontend, http_sock)
            await http.start()
        serve_metrics(self.cfg.metrics_port)
        await set_health(health_servicer, "", health_pb2.HealthCheckResponse.SERVING)
        await set_health(health_servicer, SERVICE_NAME,
                          health_pb2.HealthCheckResponse.NOT_SERVING)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        watching = asyncio.create_task(self._read_reports(reports)) if reports else None
        become_ready = partial(self._become_ready, frontend, health_servicer)
        peers = None
        starting: asyncio.Task[Any]
        if self.cfg.standalone:  # roles on their own: keep a set serving (tandem/standalone.py)
            self.keeper = SetKeeper(self.cfg, frontend, partial(set_health, health_servicer),
                                    become_ready)
            peers = asyncio.create_task(self.keeper.run())
            starting = asyncio.create_task(self.keeper.served.wait())
        else:
            starting = asyncio.create_task(become_ready())
        failed = asyncio.ensure_future(self._failure)
        stopping = asyncio.create_task(self._stop.wait())
        try:
            first: set[asyncio.Future[Any]] = {starting, failed, stopping}
            done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            if starting in done and starting.exception() is None:
                # Serve until a child dies or a signal comes.
                serving: set[asyncio.Future[Any]] = {failed, stopping}
                await asyncio.wait(serving, return_when=asyncio.FIRST_COMPLETED)
            elif starting in done:
                log.error("start-up failed: %s", starting.exception())
                self.exit_code = 1
                await asyncio.wait({failed}, timeout=2.0)  # a dying child usually explains it
            starting.cancel()
            if self.startup_error is not None:  # the caller prints it; nothing was served
                self.exit_code = 2
            elif failed.done():
                await self._fail_everything(frontend, health_servicer, failed.result())
            elif stopping.done():
                await self._drain(frontend, health_servicer)
        finally:
            for task in (watching, starting, stopping, peers):
                if task is not None:
                    task.cancel()
            if starting.done() and not starting.cancelled():
                starting.exception()  # seen (a warm-up cut short by a failure): no GC warning
            await set_health(health_servicer, SERVICE_NAME,
                              health_pb2.HealthCheckResponse.NOT_SERVING)
            await set_health(health_servicer, "", health_pb2.HealthCheckResponse.NOT_SERVING)
            frontend.serving = False
            if http is not None:
                await http.stop()
            # Cancels whatever is still open after the grace, so stop never waits for long
            # streams.
            await server.stop(grace=GRPC_STOP_GRACE)
            if self._precompile is not None:
                self._precompile.cancel()
            if frontend.guided is not None:
                await frontend.guided.close()  # its compile worker too
            engine.close()
            if reports is not None:
                reports.close()
            self.cleanup(STOP_TIMEOUT_FAILED if self.exit_code else STOP_TIMEOUT_CLEAN)
        return self.exit_code

    def _lose(self, message: str) -> None:
        """A process failed: under the launcher the server ends; roles on their own replace
        their set and the frontend stays (tandem/standalone.py)."""
        if self.keeper is not None:
            self.keeper.break_set(message)
        else:
            self._fail(message)

    def _limits(self, engine: EngineClient, tok: Tokenizer) -> Limits:
        assert engine.limits is not None
        return Limits(max_model_len=engine.limits.max_model_len,
                      max_new_tokens=self.cfg.max_new_tokens,
                      default_max_new_tokens=self.cfg.default_max_new_tokens,
                      vocab_size=engine.limits.vocab_size,
                      eos_token_ids=tuple(tok.eos_token_ids),
                      include_stop_sequence=self.cfg.include_stop_sequence)

    async def _become_ready(self, frontend: Frontend, health_servicer: object) -> None:
        engine, tok = frontend.engine, frontend.tok
        await engine.ready.wait()
        assert engine.limits is not None
        if frontend.guided is None:  # once: a replaced set of roles keeps the compiler
            # The vocabulary's fingerprint names compiled constraints: before any request.
            frontend.guided = await asyncio.to_thread(
                GuidedCompiler.for_tokenizer, tok,
                guided.settings(self.cfg, engine.limits.vocab_size))
        frontend.limits = self._limits(engine, tok)
        await self._warm_up(engine, tok)
        await set_health(health_servicer, SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        frontend.serving = True
        http = f", HTTP on port {self.cfg.http_port}" if self.cfg.http_port else ""
        log.info("serving %s on %s:%d%s", self.cfg.model, self.cfg.host, self.cfg.port, http)
        if self.cfg.guided_precompile_json and self._precompile is None:  # after readiness
            self._precompile = asyncio.create_task(frontend.guided.precompile_json())

    async def _warm_up(self, engine: EngineClient, tok: Tokenizer) -> None:
        """One short greedy request through every process before readiness turns on."""
        ids = tok.encode("warm up") or [0]
        sampling = SamplingParams(max_new_tokens=2, stop_token_ids=list(tok.eos_token_ids))
        async for _ in engine.generate(ids, sampling, OutputOptions()):
            pass

    # ------------------------------------------------------------------ failures

    async def _read_reports(self, reports: AsyncReceiver) -> None:
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

    async def _fail_everything(self, frontend: Frontend, health_servicer: object,
                               message: str) -> None:
        engine = frontend.engine
        self.exit_code = 1
        frontend.serving = False
        await set_health(health_servicer, SERVICE_NAME,
                          health_pb2.HealthCheckResponse.NOT_SERVING)
        await set_health(health_servicer, "", health_pb2.HealthCheckResponse.NOT_SERVING)
        log.error("%s; failing %d open requests and exiting", message, engine.num_in_flight)
        engine.fail_all(f"{message}; the server is shutting down")
        await _flush(engine)

    async def _drain(self, frontend: Frontend, health_servicer: object) -> None:
        engine = frontend.engine
        await set_health(health_servicer, SERVICE_NAME,
                          health_pb2.HealthCheckResponse.NOT_SERVING)
        await set_health(health_servicer, "", health_pb2.HealthCheckResponse.NOT_SERVING)
        frontend.accepting = False
        timeout = self.cfg.shutdown_timeout
        deadline = time.monotonic() + timeout
        log.info("draining %d in-flight requests (up to %g s)", engine.num_in_flight, timeout)
        assert self._failure is not None
        while engine.num_in_flight and time.monotonic() < deadline:
            if self._failure.done():  # a child died while we drained
                await self._fail_everything(frontend, health_servicer, self._failure.result())
                return
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.warning("cancelling %d requests still running after the %g s shutdown timeout",
                        engine.num_in_flight, timeout)
            engine.fail_all(f"server shut down: the request did not finish within the "
                            f"{timeout:g} s shutdown timeout")
            await _flush(engine)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s received: draining (send again to exit at once)",
                     signal.Signals(sig).name)
            self._stop.set()
        else:
            log.warning("second signal: exiting now")
            self.cleanup(STOP_TIMEOUT_FAILED)
            os._exit(128 + sig)


def _dump_stacks(child: Child) -> bool:
    """Ask a child for its stacks (faulthandler on SIGUSR1 writes them to the shared log)."""
    if child.exited_at is not None:  # reaped: its pid may belong to someone else now
        return False
    try:
        os.kill(child.proc.pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def _flush(engine: EngineClient) -> None:
    """Give failed streams the moment they need to send their status before gRPC stops."""
    deadline = time.monotonic() + FLUSH_WAIT
    while engine.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)


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
