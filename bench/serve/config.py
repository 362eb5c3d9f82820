"""The settings of one `tandem bench serve` run: every knob, and what the backend gets."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem_serve.bench.serve.backends.base import BackendOptions
from tandem_serve.bench.serve.metrics import PRINT_PERCENTILES

DEFAULT_PORTS = {"tandem": 8033, "openai-completions": 8000, "openai-chat": 8000,
                 "transformers-serve": 8000, "hf-generate": 0}
# hf-generate's static batch size when --max-concurrency is not given.
DEFAULT_HF_BATCH = 16


@dataclass
class BenchConfig:
    """Every knob of one run; `config_from_args` fills it from the command line."""

    backend: str = "tandem"
    host: str = "127.0.0.1"
    port: int = 0  # 0: the backend's usual port
    model: str = ""
    served_model_name: str = ""
    base_url: str = ""
    endpoint: str = ""
    dataset: str = "random"
    dataset_path: str = ""
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    turns: int = 4  # multi-turn: requests per conversation
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    sample: bool = False
    temperature: float = 1.0
    warmup: int = 0
    request_timeout: float | None = None
    ready_timeout: float = 0.0
    metric_percentiles: tuple[float, ...] = PRINT_PERCENTILES
    output_json: str = ""
    progress: bool = True
    progress_interval: float = 1.0
    device: str = "auto"
    dtype: str = "float32"
    guided: str = ""  # a guided_load kind: that share of the requests is constrained
    guided_share: float = 0.5
    adapters: list[str] = field(default_factory=list)  # LoRA adapter ids, request i: i % n
    # HTTP base URLs of the replicas behind --base-url's router: their counts are reported.
    replica_urls: list[str] = field(default_factory=list)

    def backend_options(self) -> BackendOptions:
        return BackendOptions(
            host=self.host, port=self.port or DEFAULT_PORTS.get(self.backend, 0),
            model=self.model, served_model_name=self.served_model_name,
            base_url=self.base_url, endpoint=self.endpoint, logprobs=self.logprobs,
            stop=list(self.stop),
            sample=self.sample, temperature=self.temperature, seed=self.seed,
            request_timeout=self.request_timeout, ready_timeout=self.ready_timeout,
            batch_size=self.max_concurrency or DEFAULT_HF_BATCH, device=self.device,
            dtype=self.dtype, adapters=list(self.adapters))
