"""`tandem serve`: the frontend process, which starts and watches every other process.

Start-up: make a private run folder for the ipc sockets, start the scheduler, the gpu
worker and N postproc workers as separate OS processes, serve gRPC, and turn readiness on
once every process has reported in and a warm-up request has gone through.
Supervision: a child that exits fails every open stream with UNAVAILABLE naming it, turns
health NOT_SERVING, stops the rest and exits non-zero.  SIGTERM/SIGINT drain; a second
signal exits at once.  On every exit the children, sockets and shm segments are removed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import generation_pb2 as pb
from proto import generation_pb2_grpc as pb_grpc
from proto.config import Addresses, ServerConfig
from proto.messages import OutputOptions, SamplingParams, Shutdown
from rpc.channels import Sender
from rpc.engine_client import EngineClient
from rpc.server import SERVICE_NAME, GenerationServicer
from rpc.tokenizer import Tokenizer
from rpc.validation import Limits

log = logging.getLogger("tandem.launcher")

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Long streams stay up: answer client keepalive pings, send our own every 60 s.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass
class Child:
    role: str
    proc: subprocess.Popen


class Launcher:
    def __init__(self, cfg: ServerConfig) -> None:
        self.run_dir = tempfile.mkdtemp(prefix=f"tandem-{os.getpid()}-")
        addr = Addresses.local(self.run_dir, str(os.getpid()), cfg.num_postproc_workers,
                               cfg.shm_ring)
        self.cfg = cfg.replace(addresses=addr)
        self.children: list[Child] = []
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._signals = 0

    # ------------------------------------------------------------------ children

    def start_children(self) -> None:
        path = os.path.join(self.run_dir, "config.json")
        with open(path, "w") as f:
            f.write(self.cfg.to_json())
        roles = [("scheduler", 0), ("gpu-worker", 0)] + [
            ("postproc", i) for i in range(self.cfg.num_postproc_workers)]
        for role, index in roles:
            cmd = [sys.executable, "-m", "rpc.cli", "run-role", role, "--config-file", path,
                   "--index", str(index), "--parent-pid", str(os.getpid())]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            name = role if role != "postproc" else f"postproc {index}"
            self.children.append(Child(name, proc))
            log.info("started %s (pid %d)", name, proc.pid)

    def dead_child(self) -> Child | None:
        for c in self.children:
            if c.proc.poll() is not None:
                return c
        return None

    def stop_children(self, timeout: float = 5.0) -> None:
        try:
            Sender(self.cfg.addresses.scheduler_inbox).put(Shutdown("server exit"), timeout=0.1)
        except Exception:  # the scheduler may be gone already
            pass
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + timeout
        for c in self.children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop; killing it", c.role)
                c.proc.kill()
                c.proc.wait()

    def cleanup(self) -> None:
        self.stop_children()
        if self.cfg.addresses.ring_name:
            from rpc.shm_ring import unlink_segment

            unlink_segment(self.cfg.addresses.ring_name)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ serving

    async def serve(self) -> int:
        tok = Tokenizer.from_dir(self.cfg.model)
        engine = EngineClient(self.cfg)
        engine.start()
        self.start_children()
        server = grpc.aio.server(options=GRPC_OPTIONS)
        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else \
            health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["GenerationService"].full_name,
             reflection.SERVICE_NAME, health.SERVICE_NAME), server)
        servicer = GenerationServicer(engine, tok)
        pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        self._bind(server)
        await server.start()
        await _set_health(health_servicer, "", health_pb2.HealthCheckResponse.SERVING)
        await _set_health(health_servicer, SERVICE_NAME,
                          health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        supervisor = asyncio.create_task(self._supervise())
        starting = asyncio.create_task(
            self._become_ready(engine, tok, servicer, health_servicer))
        try:
            done, _ = await asyncio.wait({supervisor, starting},
                                         return_when=asyncio.FIRST_COMPLETED)
            start_error = starting.exception() if starting in done else None
            if starting in done and start_error is None:
                await asyncio.wait({supervisor})  # serve until a child dies or a signal
            elif start_error is not None:  # a dying child usually explains it
                await asyncio.wait({supervisor}, timeout=2.0)
            starting.cancel()
            supervisor.cancel()
            died = supervisor.result() if supervisor.done() and not supervisor.cancelled() \
                else None
            if died is not None:
                msg = f"{died.role} process (pid {died.proc.pid}) exited with code " \
                      f"{died.proc.returncode}"
                log.error("%s; failing all requests", msg)
                engine.fail_all(msg)
                self.exit_code = 1
                await asyncio.sleep(0.1)  # let the failed streams flush their status
            elif start_error is not None:
                log.error("start-up failed: %s", start_error)
                self.exit_code = 1
            else:
                await self._drain(engine, servicer, health_servicer)
        finally:
            await _set_health(health_servicer, SERVICE_NAME,
                              health_pb2.HealthCheckResponse.NOT_SERVING)
            await _set_health(health_servicer, "", health_pb2.HealthCheckResponse.NOT_SERVING)
            await server.stop(grace=0.5)
            engine.close()
            self.cleanup()
        return self.exit_code

    def _bind(self, server: grpc.aio.Server) -> None:
        target = f"{self.cfg.host}:{self.cfg.port}"
        if self.cfg.tls_cert:
            with open(self.cfg.tls_key, "rb") as f:
                key = f.read()
            with open(self.cfg.tls_cert, "rb") as f:
                cert = f.read()
            ca = None
            if self.cfg.tls_client_ca:
                with open(self.cfg.tls_client_ca, "rb") as f:
                    ca = f.read()
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                require_client_auth=ca is not None)
            server.add_secure_port(target, creds)
        else:
            server.add_insecure_port(target)

    def _limits(self, engine: EngineClient, tok: Tokenizer) -> Limits:
        assert engine.limits is not None
        return Limits(max_model_len=engine.limits.max_model_len,
                      max_new_tokens=self.cfg.max_new_tokens,
                      default_max_new_tokens=self.cfg.default_max_new_tokens,
                      vocab_size=engine.limits.vocab_size,
                      eos_token_ids=tuple(tok.eos_token_ids),
                      include_stop_sequence=self.cfg.include_stop_sequence)

    async def _become_ready(self, engine: EngineClient, tok: Tokenizer,
                            servicer: GenerationServicer, health_servicer: object) -> None:
        await engine.ready.wait()
        servicer.limits = self._limits(engine, tok)
        await self._warm_up(engine, tok)
        await _set_health(health_servicer, SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d", self.cfg.model, self.cfg.host, self.cfg.port)

    async def _warm_up(self, engine: EngineClient, tok: Tokenizer) -> None:
        """One short greedy request through every process before readiness turns on."""
        ids = tok.encode("warm up") or [0]
        sampling = SamplingParams(max_new_tokens=2, stop_token_ids=list(tok.eos_token_ids))
        async for _ in engine.generate(ids, sampling, OutputOptions()):
            pass

    async def _supervise(self) -> Child | None:
        """The first child that exits, or None once a signal asks us to stop."""
        while not self._stop.is_set():
            dead = self.dead_child()
            if dead is not None:
                return dead
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=0.2)
            except asyncio.TimeoutError:
                pass
        return None

    async def _drain(self, engine: EngineClient, servicer: GenerationServicer,
                     health_servicer: object) -> None:
        await _set_health(health_servicer, SERVICE_NAME,
                          health_pb2.HealthCheckResponse.NOT_SERVING)
        servicer.accepting = False
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        log.info("draining %d in-flight requests (up to %.0f s)", engine.num_in_flight,
                 self.cfg.shutdown_timeout)
        while engine.num_in_flight and time.monotonic() < deadline and self._signals < 2:
            if self.dead_child() is not None:
                break
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            engine.fail_all("server shut down before the request finished")
            await asyncio.sleep(0.1)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal received: draining (send again to exit at once)")
            self._stop.set()
        else:
            log.warning("second signal: exiting now")
            self.cleanup()
            os._exit(1)


async def _set_health(servicer: object, service: str, status: int) -> None:
    result = servicer.set(service, status)  # type: ignore[attr-defined]
    if asyncio.iscoroutine(result):
        await result


def serve(cfg: ServerConfig) -> int:
    launcher = Launcher(cfg)
    try:
        return asyncio.run(launcher.serve())
    finally:
        launcher.cleanup()
