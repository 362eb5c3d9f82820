"""`LLM`: vLLM's offline entry point over Tandem's engine (`from tandem_serve import LLM`).

    llm = LLM(model="path/to/model", num_scheduler_steps=8)   # `tandem serve`'s flags
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    llm.sleep(2); llm.load_weights("path/to/new"); llm.wake_up()
    llm.shutdown()                                              # or `with LLM(...) as llm:`

The processes are `tandem serve`'s, started in the background (`tandem/offline/engine.py`);
requests are validated exactly as /v1/completions and /v1/chat/completions validate theirs
(the same code, `openai_api/chat/params.py`), so an offline output equals the server's for
the same prompt and parameters.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError as BodyError

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.engine_control import ControlResult
from tandem_serve.frontend.frontend import Prepared
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.frontend.vllm_metrics import FINISH_REASON
from tandem_serve.openai_api.chat import params as P
from tandem_serve.openai_api.chat.serving import Prompt
from tandem_serve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta
from tandem_serve.tandem.offline.engine import BackgroundEngine
from tandem_serve.tandem.offline.params import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    SamplingParams,
)

PromptInput = str | list[int] | dict[str, Any]
AUTO_PROGRESS = 16  # more prompts than this show a progress bar unless use_tqdm says
# Flags whose config field is named otherwise (`tandem serve --prefix-caching`).
_ALIASES = {"prefix_caching": "enable_prefix_caching"}
_requests = itertools.count()


def offline_config(model: str, flags: dict[str, Any]) -> ServerConfig:
    """`tandem serve`'s config from keyword arguments named as its flags; no server ports."""
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {_ALIASES.get(k, k): v for k, v in flags.items()}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"LLM() got unknown arguments {unknown}: they are `tandem serve`'s "
                        f"flags with underscores (e.g. num_scheduler_steps)")
    for key in ("adapter_cache", "chat_template"):
        if values.get(key) and os.path.exists(values[key]):
            values[key] = os.path.abspath(values[key])
    if not model:
        from tandem_serve.harness.tiny_model import ensure_default_model

        model = str(ensure_default_model(in_subprocess=True))
    return ServerConfig(model=os.path.abspath(model), http_port=0, **values)


class LLM:
    """The engine in the background; generate, chat, and the rollout controls."""

    def __init__(self, model: str = "", **flags: Any) -> None:
        cfg = offline_config(model, flags)
        self.engine = BackgroundEngine(cfg)
        # Requests in flight at once: the rest wait here, not in the engine's queue, whose
        # admission control would refuse them.
        self._slots = asyncio.Semaphore(max(1, min(cfg.max_queued_requests,
                                                   4 * cfg.max_num_seqs)))

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order.  A prompt is a string, a list of
        token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""
        items = [prompts] if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)) \
            else list(prompts)
        jobs = [(self._completion_body, p, sp) for p, sp in
                zip(items, _per_prompt(sampling_params, len(items)), strict=True)]
        return self._run(jobs, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Conversations rendered with the model's chat template (as /v1/chat/completions
        does); one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra = {"add_generation_prompt": add_generation_prompt,
                 "continue_final_message": continue_final_message,
                 "chat_template_kwargs": chat_template_kwargs}
        jobs = [(self._chat_body, (conv, extra), sp) for conv, sp in
                zip(convs, _per_prompt(sampling_params, len(convs)), strict=True)]
        return self._run(jobs, use_tqdm)

    def _run(self, jobs: list[tuple[Any, Any, SamplingParams]],
             use_tqdm: bool | None) -> list[RequestOutput]:
        prepared = self.engine.call(self._prepare_all(jobs))  # every prompt valid, or raise
        futures = [self.engine.submit(self._complete(out, choices)) for out, choices in prepared]
        show = use_tqdm if use_tqdm is not None else len(futures) > AUTO_PROGRESS
        try:
            if show:
                from tqdm import tqdm

                with tqdm(total=len(futures), desc="Processed prompts", unit="prompt",
                          file=sys.stderr) as bar:
                    for _ in concurrent.futures.as_completed(futures):
                        bar.update(1)
            return [f.result() for f in futures]
        finally:  # interrupted: abort what still runs
            for f in futures:
                f.cancel()

    async def _prepare_all(self, jobs: list[tuple[Any, Any, SamplingParams]]
                           ) -> list[tuple[RequestOutput, list[Prepared]]]:
        return [await self._prepare(*job) for job in jobs]

    async def _prepare(self, make_body: Any, prompt: Any, sp: SamplingParams
                       ) -> tuple[RequestOutput, list[Prepared]]:
        frontend = self.engine.frontend
        try:
            limits = frontend.ready_limits()
            body, text = make_body(prompt, sp)
            params = P.validate(body, limits)
            if sp.max_tokens is None:  # vLLM: up to the model length (as chat's default)
                params.chat = True
            if isinstance(body, ChatCompletionRequest):
                prompts = [await self.engine.serving.chat_prompt(body)]
            else:
                prompts = await self.engine.serving.completion_prompts(body, limits)
        except BodyError as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from None
        except (ValidationError, EngineError) as exc:
            raise ValueError(str(exc)) from None
        out = RequestOutput(str(next(_requests)), text, list(prompts[0].ids))
        return out, self._choices(params, prompts[0], limits)

    def _choices(self, params: P.Params, prompt: Prompt, limits: Any) -> list[Prepared]:
        frontend = self.engine.frontend
        try:
            req = P.for_prompt(params, len(prompt.ids), limits, prompt.field)
        except ValidationError as exc:
            raise ValueError(str(exc)) from None
        arrived = asyncio.get_running_loop().time()
        return [frontend.prepared(
            dataclasses.replace(req, sampling=dataclasses.replace(
                req.sampling, seed=P.choice_seed(params, j))),
            prompt.text, prompt.ids, frontend.engine.new_request_id(), arrived)
            for j in range(params.n)]

    @staticmethod
    def _completion_body(prompt: PromptInput, sp: SamplingParams
                         ) -> tuple[CompletionRequest, str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                return CompletionRequest.model_validate({"prompt": ids, **sp.body()}), None
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return CompletionRequest.model_validate({"prompt": prompt, **sp.body()}), prompt
        return CompletionRequest.model_validate({"prompt": list(prompt), **sp.body()}), None

    @staticmethod
    def _chat_body(prompt: tuple[list[dict[str, Any]], dict[str, Any]], sp: SamplingParams
                   ) -> tuple[ChatCompletionRequest, str | None]:
        conv, extra = prompt
        fields = sp.body()
        top = fields.pop("logprobs")
        body = ChatCompletionRequest.model_validate(
            {"messages": conv, "logprobs": top is not None, "top_logprobs": top or None,
             **fields, **{k: v for k, v in extra.items() if v is not None}})
        return body, None

    async def _complete(self, out: RequestOutput, choices: list[Prepared]) -> RequestOutput:
        async with self._slots:
            samples = await asyncio.gather(*(self._sample(j, p) for j, p in enumerate(choices)))
        out.outputs = list(samples)
        return out

    async def _sample(self, index: int, p: Prepared) -> CompletionOutput:
        ids: list[int] = []
        text: list[str] = []
        want = p.req.options.logprobs
        logprobs: list[dict[int, Logprob]] | None = [] if want else None
        last: OutputDelta | None = None
        try:
            async for d in self.engine.frontend.generate(p, f"offline-{p.rid}"):
                ids.extend(d.token_ids)
                text.append(d.text)
                if logprobs is not None:
                    logprobs.extend(_token_logprobs(d))
                last = d
        except EngineError as exc:
            raise RuntimeError(f"request failed: {exc}") from None
        reason = last.finish_reason if last is not None else FinishReason.CANCELLED
        cumulative = sum(e[t].logprob for e, t in zip(logprobs, ids, strict=False)) \
            if logprobs else None
        return CompletionOutput(index, "".join(text), ids, cumulative, logprobs,
                                FINISH_REASON.get(reason),
                                last.stop_sequence or None if last is not None else None)

    # ------------------------------------------------------------------ rollout controls

    def sleep(self, level: int = 1) -> ControlResult:
        """Free the KV cache (1) and the weights too (2) once running requests finished."""
        return self._control(self.engine.controls.sleep(level))

    def wake_up(self) -> ControlResult:
        return self._control(self.engine.controls.wake_up())

    def is_sleeping(self) -> bool:
        return self.engine.controls.is_sleeping

    def pause(self) -> ControlResult:
        """No new work starts; requests in flight wait, then finish after `resume`."""
        return self._control(self.engine.controls.pause())

    def resume(self) -> ControlResult:
        return self._control(self.engine.controls.resume())

    def reset_prefix_cache(self) -> ControlResult:
        return self._control(self.engine.controls.reset_prefix_cache())

    def load_weights(self, path: str) -> ControlResult:
        """Replace the weights in place from a checkpoint folder of the same architecture
        (every tensor-parallel rank); the prefix cache is reset.  Works while asleep."""
        return self._control(self.engine.controls.load_weights(os.path.abspath(path)))

    def _control(self, coro: Any) -> ControlResult:
        try:
            return self.engine.call(coro)
        except EngineError as exc:
            raise ValueError(str(exc)) from None

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Stop every process; nothing is left behind (processes, sockets, shared memory)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(sp: SamplingParams | Sequence[SamplingParams] | None,
                count: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * count
    if isinstance(sp, SamplingParams):
        return [sp] * count
    if len(sp) != count:
        raise ValueError(f"sampling_params: {len(sp)} given for {count} prompts")
    return list(sp)


def _token_logprobs(d: OutputDelta) -> list[dict[int, Logprob]]:
    """Per token of a delta: the chosen token's entry and the top-N alternatives'."""
    out = []
    for i, tid in enumerate(d.token_ids):
        entry: dict[int, Logprob] = {}
        if d.top_ids is not None and d.top_logprobs is not None:
            texts = d.top_texts[i] if d.top_texts is not None else None
            for r, (t, lp) in enumerate(zip(d.top_ids[i], d.top_logprobs[i], strict=True)):
                entry[t] = Logprob(lp, r + 1, texts[r] if texts else None)
        if d.logprobs is not None:
            rank = d.ranks[i] if d.ranks is not None else \
                (entry[tid].rank if tid in entry else None)  # else below the top N: unknown
            entry[tid] = Logprob(d.logprobs[i], rank,
                                 d.token_texts[i] if d.token_texts is not None else None)
        out.append(entry)
    return out
