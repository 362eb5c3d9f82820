"""The `hf-generate` backend of `tandem bench serve`: no server; static batches of
`model.generate()` in this process, the bound a server is compared with."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from tandem_serve.bench.serve.backends.base import Backend, BackendOptions, Progress, fail_record
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.metrics import RequestRecord


class _StepTimes:
    """A `generate()` streamer that records when each decode step's tokens exist on the host."""

    def __init__(self, progress: Progress, output_lens: Sequence[int]) -> None:
        self.times: list[float] = []
        self._seen_prompt = False
        self._progress = progress
        self._output_lens = list(output_lens)

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if not self._seen_prompt:  # generate() first hands over the prompt ids
            self._seen_prompt = True
            return
        step = len(self.times)
        self.times.append(now)
        # Only rows still inside their own output length produce tokens anyone asked for.
        self._progress.add_tokens(sum(1 for n in self._output_lens if n > step))

    def end(self) -> None:
        return None


class HFGenerateBackend(Backend):
    """Static batching with `model.generate()` in this process; no server, no network.

    Requests queue up; whenever the model is idle it takes up to `batch_size` of them as one
    batch (left-padded), generates max(output_len) tokens with min_new_tokens equal to it,
    and reports each request's tokens at the decode step that produced them. TTFT is the
    batch's first step (prefill + one token) since the request was queued.
    """

    name = "hf-generate"

    def __init__(self, opts: BackendOptions, tokenizer: Any = None) -> None:
        super().__init__(opts)
        self._tok = tokenizer
        self._model: Any = None
        self._device: Any = None
        self._queue: asyncio.Queue[tuple[BenchItem, RequestRecord, asyncio.Future[None]]] | None
        self._queue = None
        self._worker: asyncio.Task[None] | None = None
        self._stop_tokenizer: Any = None

    async def start(self) -> None:
        if not self.opts.model:
            raise ValueError("hf-generate needs --model DIR")
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._batcher())

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self._tok is None:
            from tandem_serve.tokenization.tokenizer import Tokenizer

            self._tok = Tokenizer.from_dir(self.opts.model)
        device = self.opts.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        dtype = getattr(torch, self.opts.dtype) if self.opts.dtype != "auto" else "auto"
        self._model = AutoModelForCausalLM.from_pretrained(self.opts.model, dtype=dtype)
        self._model.to(self._device).eval()
        if self.opts.stop:
            # generate()'s stop_strings needs an HF tokenizer to map strings to tokens.
            from transformers import AutoTokenizer

            self._stop_tokenizer = AutoTokenizer.from_pretrained(self.opts.model)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    async def run_one(self, item: BenchItem) -> RequestRecord:
        assert self._queue is not None, "start() first"
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, rec, done))
        await done
        return rec

    async def _batcher(self) -> None:
        assert self._queue is not None
        q = self._queue
        while True:
            batch = [await q.get()]
            # Requests released together (a semaphore handing out slots, a burst) reach the
            # queue over a few loop turns; take them all before the model gets busy.
            still = 0
            while len(batch) + q.qsize() < self.opts.batch_size and still < 5:
                before = q.qsize()
                await asyncio.sleep(0)
                still = still + 1 if q.qsize() == before else 0
            while q.qsize() and len(batch) < self.opts.batch_size:
                batch.append(q.get_nowait())
            try:
                await asyncio.to_thread(self._generate, [(it, rec) for it, rec, _ in batch])
            except Exception as e:  # the whole batch failed together
                for _, rec, _ in batch:
                    fail_record(rec, f"{type(e).__name__}: {e}")
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    def _generate(self, batch: Sequence[tuple[BenchItem, RequestRecord]]) -> None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        model, tok = self._model, self._tok
        prompts = [tok.encode(item.prompt) for item, _ in batch]
        width = max(len(p) for p in prompts)
        pad_id = model.generation_config.pad_token_id
        if pad_id is None:
            pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
        ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every row's last token lines up
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        n_new = max(item.output_len for item, _ in batch)
        streamer = _StepTimes(self.progress, [item.output_len for item, _ in batch])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=n_new, min_new_tokens=n_new, do_sample=self.opts.sample,
            pad_token_id=int(pad_id), streamer=streamer, top_k=None, top_p=None)
        if self.opts.sample:
            kwargs["temperature"] = self.opts.temperature
            torch.manual_seed(self.opts.seed + batch[0][0].index)
        else:
            kwargs["temperature"] = None
        if self.opts.logprobs is not None:
            n_top = self.opts.logprobs

            class _TopN(LogitsProcessor):
                # The work a server does for token detail: normalise, pick the top N.
                def __call__(self, input_ids: torch.Tensor,
                             scores: torch.Tensor) -> torch.Tensor:
                    lp = torch.log_softmax(scores.float(), dim=-1)
                    torch.topk(lp, max(n_top, 1), dim=-1)
                    return scores

            kwargs["logits_processor"] = LogitsProcessorList([_TopN()])
        if self._stop_tokenizer is not None:
            kwargs["stop_strings"] = list(self.opts.stop)
            kwargs["tokenizer"] = self._stop_tokenizer
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(self._device),
                                 attention_mask=mask.to(self._device), **kwargs)
        gen = out[:, width:].cpu().tolist()
        times = streamer.times
        for row, (item, rec) in enumerate(batch):
            n = min(item.output_len, len(times), len(gen[row]))
            if self._stop_tokenizer is not None:
                # A row that hit a stop string was padded afterwards; its last real token
                # is the last non-pad one.
                while n > 0 and gen[row][n - 1] == pad_id:
                    n -= 1
            for t in times[:n]:
                rec.add_chunk(t, 1)
            rec.input_tokens = len(prompts[row])
            rec.output_tokens = n
            rec.generated_text = tok.decode(gen[row][:n], skip_special_tokens=True)
            rec.end_time = times[n - 1] if n else time.perf_counter()
            rec.success = True
