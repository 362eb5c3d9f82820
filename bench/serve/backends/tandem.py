"""The Tandem backend of `tandem bench serve`: gRPC GenerateStream over `grpc.aio`."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from tandem_serve.bench.serve.backends.base import Backend, BackendOptions, fail_record
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.metrics import RequestRecord


class TandemBackend(Backend):
    """gRPC GenerateStream with a fixed output length (min_new_tokens = max_new_tokens)."""

    name = "tandem"

    def __init__(self, opts: BackendOptions) -> None:
        super().__init__(opts)
        self._channel: Any = None
        self._stub: Any = None

    async def start(self) -> None:
        import grpc

        from tandem_serve.proto import generation_pb2_grpc as pb_grpc

        target = f"{self.opts.host}:{self.opts.port}"
        self._channel = grpc.aio.insecure_channel(
            target, options=[("grpc.max_receive_message_length", 64 << 20),
                             ("grpc.max_send_message_length", 64 << 20)])
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        if self.opts.ready_timeout > 0:
            await self._wait_ready(self.opts.ready_timeout)

    async def _wait_ready(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        req = health_pb2.HealthCheckRequest(service="fmaas.GenerationService")
        while True:
            try:
                resp = await health.Check(req, timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.opts.host}:{self.opts.port} not SERVING after "
                                   f"{timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def request(self, item: BenchItem) -> Any:
        from tandem_serve.proto import generation_pb2 as pb
        from tandem_serve.rpc.client import GenerateOptions

        opts = GenerateOptions(max_new_tokens=item.output_len, min_new_tokens=item.output_len,
                               stop_sequences=list(self.opts.stop))
        if item.guided:  # the constraint says when the output is complete (EOS)
            opts = dataclasses.replace(opts, min_new_tokens=0, **item.guided)
        if self.opts.sample:
            opts.sample = True
            opts.temperature = self.opts.temperature
            opts.seed = self.opts.seed + item.index
        if self.opts.logprobs is not None:
            # Token detail is the postprocessing load to measure: text, logprob, top-N.
            opts.generated_tokens = True
            opts.token_logprobs = True
            opts.top_n_tokens = self.opts.logprobs
        req = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=item.prompt),
                                         params=opts.to_proto())
        if self.opts.adapters:
            req.adapter_id = self.opts.adapters[item.index % len(self.opts.adapters)]
        return req

    async def run_one(self, item: BenchItem) -> RequestRecord:
        import grpc

        from tandem_serve.proto import generation_pb2 as pb

        req = self.request(item)
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        text: list[str] = []
        generated = 0
        stop_reason = 0
        try:
            call = self._stub.GenerateStream(
                req, timeout=self.opts.request_timeout,
                metadata=(("x-correlation-id", f"bench-{item.index}"),))
            async for resp in call:
                now = time.perf_counter()
                if resp.generated_token_count > generated:
                    # The cumulative count, not len(tokens): with multi-step streaming one
                    # message carries several tokens, and detail may be off.
                    new = resp.generated_token_count - generated
                    generated = resp.generated_token_count
                    rec.add_chunk(now, new)
                    self.progress.add_tokens(new)
                if resp.input_token_count:
                    rec.input_tokens = resp.input_token_count
                if resp.text:
                    text.append(resp.text)
                if resp.stop_reason:
                    stop_reason = resp.stop_reason
        except grpc.aio.AioRpcError as e:
            return fail_record(rec, f"{e.code().name}: {e.details()}")
        except Exception as e:  # a bench must report, not die, when one stream breaks
            return fail_record(rec, f"{type(e).__name__}: {e}")
        rec.end_time = time.perf_counter()
        rec.output_tokens = generated
        rec.generated_text = "".join(text)
        if stop_reason == pb.ERROR:
            return fail_record(rec, "stop_reason ERROR")
        rec.success = True
        return rec
