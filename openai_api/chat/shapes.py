"""What the two endpoints answer: the same engine deltas in two JSON shapes.

A request of p prompts with `n` choices each runs p·n engine requests, one per `Choice`
(index i·n + j, OpenAI's order). `CompletionShape` and `ChatShape` turn a choice's deltas
into stream chunks (`chunks`) or fold them into the final response (`add`, `response`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem_serve.frontend.frontend import Prepared
from tandem_serve.frontend.vllm_metrics import FINISH_REASON
from tandem_serve.openai_api.agents.message import MessageStream, Output, message_deltas
from tandem_serve.openai_api.chat.logprobs import CompletionLogprobs, TokenPieces, chat_logprobs
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta

# OpenAI has "stop" and "length"; vLLM adds "abort" for requests ended from outside. The same
# strings label vllm:request_success_total.
FINISH = FINISH_REASON


@dataclass
class Reply:
    """Per request: what every chunk or response repeats, and what the client asked back."""

    id: str
    created: int
    model: str
    include_usage: bool = False  # stream: a last chunk with the usage
    continuous_usage: bool = False  # stream: the usage so far on every chunk
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids


@dataclass
class Choice:
    index: int
    prompt_index: int
    p: Prepared
    prompt_text: str  # what echo repeats
    echo: bool = False
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    generated: int = 0
    finish: FinishReason = FinishReason.NOT_FINISHED
    stop_sequence: str = ""
    offset: int = 0  # characters returned so far (completions' text_offset)
    logprobs: Any = None  # CompletionLogprobs or chat content entries, non-stream
    started: bool = False
    eos_ids: frozenset[int] = frozenset()  # the model's (a finish on another is a stop id)
    # Chat with tools or a reasoning parser: how the text reads as a message (None: content).
    output: Output | None = None
    message: MessageStream | None = None  # streamed: the parse so far

    def update(self, d: OutputDelta) -> None:
        if d.num_generated >= 0:
            self.generated = d.num_generated
        self.finish = d.finish_reason
        self.stop_sequence = d.stop_sequence

    @property
    def finish_reason(self) -> str | None:
        return FINISH.get(self.finish)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's: the stop string that ended it, or a stop token id other than EOS."""
        if self.finish == FinishReason.STOP_SEQUENCE:
            return self.stop_sequence
        if self.finish == FinishReason.EOS_TOKEN and self.token_ids \
                and self.token_ids[-1] not in self.eos_ids:
            return self.token_ids[-1]
        return None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Shape:
    """What a completion and a chat answer share: the envelope and vLLM's token ids."""

    object = ""

    def __init__(self, reply: Reply, pieces: TokenPieces) -> None:
        self.reply = reply
        self.pieces = pieces

    def choice_json(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def _with_ids(self, c: Choice, out: dict[str, Any]) -> dict[str, Any]:
        if self.reply.return_token_ids:
            out["token_ids"] = c.token_ids
            out["prompt_token_ids"] = list(c.p.ids)
        return out

    def response(self, choices: list[Choice], use: dict[str, int]) -> dict[str, Any]:
        return {"id": self.reply.id, "object": self.object, "created": self.reply.created,
                "model": self.reply.model, "choices": [self.choice_json(c) for c in choices],
                "usage": use}


class CompletionShape(_Shape):
    object = "text_completion"

    def _logprobs(self, c: Choice, d: OutputDelta, first: bool,
                  lp: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        if not c.p.req.options.logprobs:
            return None
        lp = lp or CompletionLogprobs(self.pieces)
        if first and c.echo:
            c.offset = lp.add_prompt(c.p.ids, d.prompt_logprobs, d.prompt_top_texts,
                                     d.prompt_top_logprobs, c.offset)
        c.offset = lp.add(d.token_ids, d.logprobs, d.top_ids, d.top_logprobs, c.offset)
        return lp

    def chunks(self, c: Choice, d: OutputDelta) -> list[dict[str, Any]]:
        first = not c.started
        c.started = True
        c.update(d)
        c.token_ids += d.token_ids
        text = (c.prompt_text + d.text) if first and c.echo else d.text
        lp = self._logprobs(c, d, first)
        if not lp:
            c.offset += len(text)
        if not (text or lp or c.finish_reason or self.reply.return_token_ids):
            return []
        choice: dict[str, Any] = {"index": c.index, "text": text,
                                  "logprobs": lp.to_json() if lp else None,
                                  "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason}
        if self.reply.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
            if first:
                choice["prompt_token_ids"] = list(c.p.ids)
        return [{"id": self.reply.id, "object": self.object, "created": self.reply.created,
                 "model": self.reply.model, "choices": [choice]}]

    def add(self, c: Choice, d: OutputDelta) -> None:
        first = not c.started
        c.started = True
        c.update(d)
        c.token_ids += d.token_ids
        if first and c.echo:
            c.parts.append(c.prompt_text)
        c.parts.append(d.text)
        if c.p.req.options.logprobs:
            c.logprobs = self._logprobs(c, d, first, c.logprobs)

    def choice_json(self, c: Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": c.index, "text": "".join(c.parts),
                               "logprobs": c.logprobs.to_json() if c.logprobs else None,
                               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return self._with_ids(c, out)



class ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _content_logprobs(self, c: Choice, d: OutputDelta) -> list[dict[str, Any]] | None:
        if not c.p.req.options.logprobs:
            return None
        return chat_logprobs(self.pieces, d.token_ids, d.logprobs, d.top_ids, d.top_logprobs)

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.reply.id, "object": self.chunk_object, "created": self.reply.created,
                "model": self.reply.model, "choices": [choice]}

    def chunks(self, c: Choice, d: OutputDelta) -> list[dict[str, Any]]:
        out = []
        if not c.started:  # the role once the first token exists, as OpenAI sends it
            c.started = True
            head: dict[str, Any] = {"index": c.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}
            if self.reply.return_token_ids:
                head["prompt_token_ids"] = list(c.p.ids)
            out.append(self._chunk(head))
        c.update(d)
        c.token_ids += d.token_ids
        lps = self._content_logprobs(c, d)
        if c.message is not None:
            return out + self._message_chunks(c, d, lps)
        if not (d.text or lps or c.finish_reason or self.reply.return_token_ids):
            return out
        choice: dict[str, Any] = {"index": c.index, "delta": {"content": d.text} if d.text
                                  else {}, "logprobs": {"content": lps} if lps is not None
                                  else None, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason}
        if self.reply.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        out.append(self._chunk(choice))
        return out

    def _message_chunks(self, c: Choice, d: OutputDelta, lps: list[dict[str, Any]] | None
                        ) -> list[dict[str, Any]]:
        """Reasoning, content and tool calls as separate chunks, in that order; the last one
        carries the finish reason."""
        assert c.message is not None and c.output is not None
        parts = message_deltas(c.message.feed(d.text, c.finish_reason is not None),
                               c.output.reasoning is not None)
        finish = c.output.finish_reason(c.finish_reason, c.message.has_calls)
        if not parts and (lps or finish or self.reply.return_token_ids):
            parts = [{}]
        out = []
        for k, delta in enumerate(parts):
            last = k == len(parts) - 1
            choice: dict[str, Any] = {
                "index": c.index, "delta": delta,
                "logprobs": {"content": lps} if lps is not None and k == 0 else None,
                "finish_reason": finish if last else None,
                "stop_reason": c.stop_reason if last else None}
            if self.reply.return_token_ids and k == 0:
                choice["token_ids"] = list(d.token_ids)
            out.append(self._chunk(choice))
        return out

    def add(self, c: Choice, d: OutputDelta) -> None:
        c.started = True
        c.update(d)
        c.token_ids += d.token_ids
        c.parts.append(d.text)
        lps = self._content_logprobs(c, d)
        if lps is not None:
            c.logprobs = (c.logprobs or []) + lps

    def choice_json(self, c: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(c.parts)}
        finish = c.finish_reason
        if c.output is not None:
            parsed = c.output.message("".join(c.parts))
            message = parsed.to_json(c.output.reasoning is not None)
            finish = c.output.finish_reason(finish, bool(parsed.calls))
        out: dict[str, Any] = {
            "index": c.index, "message": message,
            "logprobs": {"content": c.logprobs or []} if c.p.req.options.logprobs else None,
            "finish_reason": finish, "stop_reason": c.stop_reason}
        return self._with_ids(c, out)

