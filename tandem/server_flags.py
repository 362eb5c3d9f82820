"""`tandem serve`'s flags: one argparse declaration per ServerConfig field.

Declarations only; `tandem/cli.py` lays the `TANDEM_<FLAG>` environment defaults over them
(environment variables are read there and nowhere else).
"""
from __future__ import annotations

import argparse
import os

from tandem_serve.proto.config import ServerConfig


def bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default,
                   help=help)


def add_server_flags(p: argparse.ArgumentParser, cache_dir: str) -> None:
    """Every `tandem serve` flag, with ServerConfig's defaults (the environment's are laid
    over them by `cli.add_server_arguments`); `cache_dir`: Tandem's cache folder."""
    d = ServerConfig(model="")
    p.add_argument("--model", default="",
                   help="Hugging Face model folder (default: the embedded tiny model)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--dtype", default=d.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                   help="K: decode steps per plan (1 = no multi-step)")
    bool_flag(p, "async-postproc", d.async_postproc,
               "overlap postprocessing with the next plan (--no-async-postproc: sync baseline)")
    bool_flag(p, "pace-plans", d.pace_plans,
               "async mode: build plan n+1 near the end of plan n (the worker says when), so "
               "requests that arrive during plan n join plan n+1 (--no-pace-plans: as soon "
               "as plan n is sent)")
    p.add_argument("--plan-lead-ms", type=float, default=d.plan_lead_ms,
                   help="with --pace-plans: how much of plan n's work is left, at least, when "
                        "the worker asks for plan n+1 (covers building and sending it)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step: decoding rows first, prefill chunks in the rest "
                        "(0: 160 on a CPU device, 512 on CUDA; a prefill token counts more at "
                        "long contexts; with --prefill-phase per plan, 0: 2048)")
    bool_flag(p, "prefill-phase", d.prefill_phase,
               "baseline: prefill each plan's chunks in a forward of their own before its "
               "decode steps (decoding rows wait for it), instead of inside the steps")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="0: the model's max_position_embeddings")
    p.add_argument("--num-postproc-workers", type=int, default=d.num_postproc_workers)
    bool_flag(p, "shm-ring", d.shm_ring, "token batches over shared memory (else ZeroMQ)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                   help="KV cache size in GiB (when --num-kv-blocks is 0)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="KV cache element type: auto (the model dtype) or fp8 (= fp8_e4m3: "
                        "float8 e4m3, scale 1.0, twice the blocks of bfloat16 per GiB)")
    bool_flag(p, "prefix-caching", d.enable_prefix_caching, "automatic prefix caching")
    p.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size,
                   metavar="GIB",
                   help="host-memory KV tier: GiB of host memory (summed over tensor-parallel "
                        "ranks; pinned on CUDA) that blocks evicted from the device cache move "
                        "to, and come back from instead of being recomputed (0: off)")
    p.add_argument("--kv-events-config", default=d.kv_events_config, metavar="JSON",
                   help='publish prefix-cache events as vLLM does: {"enable_kv_cache_events": '
                        'true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": ""} (default: off)')
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests)
    p.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens)
    p.add_argument("--scheduling-policy", default=d.scheduling_policy,
                   choices=["fcfs", "priority"],
                   help="the waiting queue's order: fcfs, or priority (a request's priority "
                        "field, lower first, ties by arrival; a higher-priority request "
                        "preempts lower-priority running ones when seats or KV run out)")
    p.add_argument("--max-stream-buffer-bytes", type=int, default=d.max_stream_buffer_bytes,
                   help="output held for a client that stopped reading before its request is "
                        "cancelled with RESOURCE_EXHAUSTED (0: no limit)")
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="the largest max_new_tokens a request may ask for")
    bool_flag(p, "include-stop-sequence", d.include_stop_sequence,
               "default for requests that leave include_stop_sequence unset")
    p.add_argument("--torch-threads", type=int, default=d.torch_threads,
                   help="gpu worker's torch threads (0: one per core it is pinned to)")
    bool_flag(p, "enforce-eager", d.enforce_eager,
               "CUDA: launch every decode step from Python, no CUDA graphs")
    bool_flag(p, "onednn", d.onednn,
               "CPU float32: linear layers through oneDNN with pre-packed weights")
    p.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape, made on the device "
                        "(benchmarks without a checkpoint)")
    p.add_argument("--attention-backend", default=d.attention_backend, metavar="NAME",
                   help="how the gpu worker attends: auto (flash where flash_attn serves, "
                        "else flex on CUDA, else sdpa), sdpa (torch SDPA over gathered "
                        "blocks; mixed steps split), flex (mixed steps in one FlexAttention "
                        "call), flash (flash_attn 2 reads the paged cache: CUDA, 16-bit, "
                        "--block-size a multiple of 256)")
    bool_flag(p, "flash-attn", d.flash_attn,
               "--attention-backend auto may pick flash_attn (--no-flash-attn: never)")
    p.add_argument("--reserved-cpus", type=int, default=d.reserved_cpus,
                   help="CPU device: cores kept for the other processes, the gpu worker "
                        "pinned to the rest (-1: 1 on a host with ≥ 2 cores; 0: no pinning)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="split the model over this many gpu worker ranks (processes) joined "
                        "by torch.distributed: NCCL on CUDA, gloo on CPU")
    p.add_argument("--nnodes", type=int, default=d.nnodes,
                   help="hosts the tensor-parallel ranks are spread over (each runs "
                        "--tensor-parallel-size / --nnodes ranks)")
    p.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this host's index among --nnodes (0: the host of rank 0 and the "
                        "frontend; others: `tandem run-role gpu-worker --node-rank R`)")
    p.add_argument("--dist-init-addr", default=d.dist_init_addr,
                   help="HOST:PORT of the torch.distributed rendezvous on rank 0's host "
                        "(PORT + 1 carries the plans); default on one host: a free local port")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM, seconds in-flight requests may take before they are "
                        "cancelled")
    p.add_argument("--step-timeout", type=float, default=d.step_timeout,
                   help="a plan unfinished after this many seconds means a hung gpu worker: "
                        "its stack is logged and the server exits non-zero (0: off)")
    p.add_argument("--guided-cache-dir", default=os.path.join(cache_dir, "guided"),
                   help="compiled guided-decoding constraints are kept here across restarts "
                        "('' = in memory only; default: <cache folder>/guided)")
    p.add_argument("--guided-compile-timeout", type=float, default=d.guided_compile_timeout,
                   help="seconds one constraint may take to compile; a longer one is stopped "
                        "and its request gets INVALID_ARGUMENT")
    bool_flag(p, "guided-precompile-json", d.guided_precompile_json,
               "compile format=JSON (any JSON object, seconds to compile) in the background "
               "once the server is ready, unless the cache has it")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port)
    p.add_argument("--http-port", type=int, default=d.http_port,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on --host; 0: off")
    bool_flag(p, "enable-control-endpoints", d.enable_control_endpoints,
               "HTTP: the rollout controls POST /sleep?level=N, /wake_up, /pause, /resume, "
               "/reset_prefix_cache, /load_weights and GET /is_sleeping (404 without)")
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="the model name HTTP clients send (default: the model folder's name)")
    bool_flag(p, "enable-auto-tool-choice", d.enable_auto_tool_choice,
               "HTTP: tool_choice 'auto' (the default with tools): calls parsed out of the "
               "model's text by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=d.tool_call_parser, metavar="NAME",
                   help="how the model writes tool calls: hermes (Qwen, Hermes), llama3_json, "
                        "mistral")
    p.add_argument("--reasoning-parser", default=d.reasoning_parser, metavar="NAME",
                   help="HTTP: split <think>...</think> into reasoning_content: deepseek_r1, "
                        "qwen3")
    p.add_argument("--chat-template", default=d.chat_template, metavar="FILE",
                   help="a chat template (a file, or the template's text) replacing the "
                        "checkpoint's")
    p.add_argument("--adapter-cache", default=d.adapter_cache, metavar="DIR",
                   help="LoRA adapters: a request's adapter_id (over HTTP: its model) names "
                        "the PEFT adapter folder DIR/<adapter_id> (default: adapters off)")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters the gpu worker holds at once (least recently used ones "
                        "no running request uses make room)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest adapter rank served (the device cost per token grows "
                        "with it)")
    bool_flag(p, "allow-runtime-lora-updating", d.allow_runtime_lora_updating,
               "HTTP POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): serve a "
               "PEFT folder under a name of the caller's choosing (needs --adapter-cache)")
    p.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2} (default: off)')
    p.add_argument("--limit-mm-per-prompt", default=d.limit_mm_per_prompt, metavar="JSON",
                   help='images a prompt may hold on a vision-language model, as vLLM spells '
                        'it: {"image": 4} (default: 8)')
    p.add_argument("--allowed-local-media-path", default=d.allowed_local_media_path,
                   metavar="DIR", help="file:// image URLs may read images under DIR "
                                       "(default: file:// URLs are refused)")
    p.add_argument("--runner", default=d.runner, choices=["generate", "pooling"],
                   help="generate: text (completions, chat); pooling: embeddings, rerank and "
                        "score from a sentence-transformers folder or a cross-encoder "
                        "(/v1/embeddings, /v1/rerank, /score)")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-client-ca", default="")
    p.add_argument("--api-key", default=d.api_key, metavar="KEY",
                   help="every /v1/* route (and the control endpoints) and every gRPC service "
                        "but health need `Authorization: Bearer KEY`; prefer TANDEM_API_KEY, "
                        "which `ps` does not show (default: open)")
    p.add_argument("--otlp-traces-endpoint", default=d.otlp_traces_endpoint, metavar="URL",
                   help="export one OpenTelemetry span per request (gen_ai.* attributes) to "
                        "this OTLP/HTTP collector, e.g. http://otel-collector:4318/v1/traces")
    p.add_argument("--liveness-timeout", type=float, default=d.liveness_timeout,
                   metavar="SECONDS",
                   help="GET /live answers 503 when requests are open and no engine plan has "
                        "completed for this long (a wedged gpu worker or scheduler)")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--fault", default="", help=argparse.SUPPRESS)
