"""The sections of `tandem bench report` that run one command each (and the fuzz run):
machine, decode step, recording overhead, guided decoding, tensor parallelism,
postprocessing, channels, LoRA, soak, robustness."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from tandem_serve.bench.report.commands import Context, command_section, progress
from tandem_serve.harness.processes import REPO_ROOT


def machine(ctx: Context) -> str:
    import torch

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    return "\n".join([
        f"Machine: {os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, "
        f"{'CUDA ' + str(torch.version.cuda) if torch.cuda.is_available() else 'no GPU'}; "
        f"Python {platform.python_version()}, torch {torch.__version__}.",
        f"Generated {time.strftime('%Y-%m-%d')} at commit {commit} by `tandem bench report` "
        "(`make benchmarks`); shared machines are noisy, so compare figures as ratios "
        "inside one table. Tiny checkpoints: `tandem make-tiny-model /tmp/tiny-default` "
        "(hidden 256, 4 layers, 32k vocab) and `--preset fast` (hidden 64, 2 layers)."])


def step(ctx: Context) -> str:
    return command_section(ctx, (
        "Decode ms/step through `ModelRunner.execute` (K=8 plans, every step published) "
        "next to HF `generate()` on the same checkpoint and batch; 128-token prompts, 64 "
        "timed steps, medians of alternating runs. Packed linears pad their rows to a "
        "bounded set of sizes (batch ≤ 16 and powers of two run unpadded; see the soak)."),
        ["bench", "step", "--model", ctx.models["default"], "--threads", "2"])


def overhead(ctx: Context) -> str:
    return command_section(ctx, (
        "What span recording costs the gpu worker's decode step: runs with the tracer off "
        "and on alternate; one span is also timed alone (targets: off < 1%, on < 5% of a "
        "step). The on/off ratio of whole runs scatters with the neighbours on a shared "
        "machine; the per-span cost × spans per step is the figure to read."),
        ["bench", "step", "--trace", "--model", ctx.models["default"], "--threads", "1",
         "--batch-sizes", "1,8,32,64", "--repeats", "4"])


def guided(ctx: Context) -> str:
    return command_section(ctx, (
        "What guided decoding costs a decode step: a 32-row batch of the fast preset (the "
        "32000-token vocabulary) with no guided rows, then half its rows under a regex, a "
        "choice and a JSON schema (device tables) or the same schema as a grammar "
        "(llguidance on the host), K=8, one thread. Each arm has its own runner and their "
        "plans take turns; the ratio is the median of per-round ratios to the unguided "
        "plan. The fast preset's step is mostly the LM head and the argmax over 32000 "
        "logits, so a [rows, vocab] pass is a large share of it: the worst case for the "
        "mask's relative cost."),
        ["bench", "step", "--guided", "--model", ctx.models["fast"], "--batch-sizes", "32",
         "--threads", "1", "--repeats", "5"])


def guided_serve(ctx: Context) -> str:
    return command_section(ctx, (
        "Guided requests served: one fast-preset server (K=8 async), the same seeded "
        "workload unguided and with half its requests under each kind, arms alternating. A "
        "guided request ends when its constraint is complete (a phone number, a colour, a "
        "small record, a sum, any JSON object), so guided rows share the batch for only part "
        "of a run; the step table above keeps half the rows guided throughout. Each run's "
        "constraints are new to the server, so its first guided request waits for a cold "
        "compile (format=JSON excepted: the server compiles it at start-up)."),
        ["bench", "guided", "--model", ctx.models["fast"], "--repeats", str(ctx.repeats),
         "--output-json", "/tmp/tandem-bench-guided.json"])


def tensor_parallel(ctx: Context) -> str:
    return command_section(ctx, (
        "Tensor parallelism on this CPU: two gpu worker ranks over gloo next to one, one "
        "torch thread per rank, the same cores; K=8 plans, median ms per decode step. A "
        "correctness feature here (each step runs gloo collectives over loopback TCP); "
        "speed needs GPUs and NVLink."),
        ["bench", "step", "--model", ctx.models["default"], "--tensor-parallel-size", "2"])


def postproc(ctx: Context) -> str:
    return command_section(
        ctx, "Postprocessing throughput next to the decode it has to keep up with.",
        ["bench", "postproc", "--model", ctx.models["default"], "--steps", "100"], fenced=True)


def ipc(ctx: Context) -> str:
    return command_section(ctx, "Token channels: the shared-memory ring next to ZeroMQ.",
                           ["bench", "ipc"], fenced=True)


def lora(ctx: Context) -> str:
    serving = command_section(ctx, (
        "LoRA on the default preset, K=8 async, one server: the same workload (32 concurrent "
        "requests, 128-token prompts, 64 output tokens) on the base model alone, every "
        "request on one adapter, and requests spread over 4 adapters (rank 16, every linear "
        "layer); arms alternate, medians of the repeats. Eager forwards group a plan's rows "
        "by adapter, so each token pays only its own adapter's rank."),
        ["bench", "lora", "--model", ctx.models["default"], "--repeats", str(ctx.repeats),
         "--num-prompts", "96", "--output-json", "/tmp/tandem-bench-lora.json"])
    step = command_section(ctx, (
        "The device side alone, where a shared machine's noise is smaller: decode ms/step "
        "through `ModelRunner.execute` in one process (one torch thread, batch 32, K=8 "
        "plans), arms alternating."),
        ["bench", "lora", "--step", "--model", ctx.models["default"], "--repeats", "8"])
    return serving + "\n\n" + step


def pooling(ctx: Context) -> str:
    return command_section(ctx, (
        "Embeddings (`--runner pooling`): 512 short texts (5-15 words) through the server's "
        "`/v1/embeddings` with the `openai` client, next to sentence-transformers' `encode()` "
        "in one process on the same machine (run first, alone, with torch's default "
        "threads and with one); ratio = texts/s over the faster `encode()`'s. The server's "
        "gpu worker is pinned to one core (`--reserved-cpus` 1), the frontend and scheduler "
        "to the other."),
        ["bench", "pooling", "--output-json", "/tmp/tandem-bench-pooling.json"], fenced=True)


def offload(ctx: Context) -> str:
    return command_section(ctx, (
        "The host KV tier (`--kv-offloading-size`) against the device cache alone, each arm "
        "on a fresh server of the default preset with a 2,048-token device cache (128 blocks). "
        "Re-send: a 1,700-token prompt, a longer one that evicts it, then the first again, "
        "one at a time; its TTFT is a recompute of the prompt without the tier and a copy "
        "back with it. Multi-turn: `bench serve --dataset multi-turn`, 8 conversations of 4 "
        "turns (a 600-token opening, 200 tokens more per turn, 16 generated), round-robin at "
        "concurrency 2, so each turn finds its conversation's history evicted from the "
        "device: TTFT p50 and throughput. One run per arm: the ratios are the figures."),
        ["bench", "offload", "--model", ctx.models["default"], "--output-json",
         "/tmp/tandem-bench-offload.json"], fenced=False)


def soak(ctx: Context) -> str:
    return command_section(
        ctx, "Steady load; resident memory of every process at the start and the end. Two "
        "things used to grow and are fixed: the gpu worker, by one oneDNN JIT primitive per "
        "new row count in two never-evicting caches (rows are now padded to 8 sizes per "
        "octave, `gpu_worker.models.layers.onednn_rows`; `--no-onednn` stayed flat), and the "
        "frontend, by the `tokenizers` BPE word cache keeping every whole prompt as one word "
        "(now off where a word is the whole text). Run on an empty model cache, so the "
        "first start also builds the tiny model (in a child process, not the frontend). The "
        "mix: plain, token-detail (logprobs, ranks, top-n), stop-sequence, sampled and "
        "cancelled-mid-stream requests (`--mix`), guided ones with `--guided-share`.",
        ["bench", "soak", "--minutes", f"{ctx.soak_minutes:g}", "--guided-share", "0.15",
         "--server-args", "--num-scheduler-steps 8"], fenced=True,
        timeout=ctx.soak_minutes * 60 + 900)


def fuzz(ctx: Context) -> str:
    """The gRPC fuzz test at report size; its outcome counts by status code."""
    path = os.path.join(tempfile.mkdtemp(prefix="tandem-report-"), "fuzz.json")
    env = {**os.environ, "TANDEM_FUZZ_EXAMPLES": str(ctx.fuzz_examples),
           "TANDEM_FUZZ_SEED": "1", "TANDEM_FUZZ_REPORT": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
           "tests/fuzz/test_grpc_fuzz.py"]
    progress("$ " + " ".join(cmd[1:]))
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, text=True, capture_output=True)
    tail = result.stdout.strip().splitlines()[-1:] or ["no output"]
    if not os.path.exists(path):  # it failed before its last test: show why
        raise RuntimeError(f"the fuzz run wrote no report:\n{result.stdout[-4000:]}")
    with open(path) as f:
        r = json.load(f)
    rows = ["| status | requests |", "|---|---:|"] + [
        f"| {code} | {n} |" for code, n in sorted(r["by_status"].items(), key=lambda x: -x[1])]
    bad = sum(r["by_status"].get(c, 0) for c in ("INTERNAL", "UNKNOWN", "UNAVAILABLE",
                                                   "UNIMPLEMENTED", "DEADLINE_EXCEEDED"))
    return "\n\n".join([
        f"`make fuzz FUZZ_EXAMPLES={ctx.fuzz_examples} FUZZ_SEED=1`: {r['requests']} requests "
        "generated from `generation.proto`'s descriptors (every field; NaN, ±inf, huge and "
        "negative numbers, unknown enum numbers, empty and 1 MB texts) and as raw wire bytes "
        "(invalid UTF-8 in any string field, truncated and random bytes) against one "
        "fast-preset server with guided decoding and an (empty) adapter cache, so guided "
        "constraints and adapter ids are validated too; then health, every KV block free, "
        f"and greedy output equal to HF. pytest: {tail[0]}. "
        f"INTERNAL/UNKNOWN/UNAVAILABLE/UNIMPLEMENTED/hangs: {bad}.", "\n".join(rows)])


def robustness(ctx: Context) -> str:
    head = fuzz(ctx)
    return "\n\n".join([head, command_section(ctx, (
        "Overload (a burst of 10x what admission control admits, released at once), clients "
        "that stop reading (with the stream buffer limit and without one), a hundred clients "
        "vanishing mid-stream, and role restarts of the compose deployment played with local "
        "processes (each role killed in turn; compose's restart policy brings it back). The "
        "stalled clients' figure to compare is the frontend's RSS with them all stalled, with "
        "and without the limit (same load); its idle size right after start-up is above its "
        "steady size (the soak shows the same drop), so the signed difference says little."),
        ["bench", "robustness", "--model", ctx.models["default"]], fenced=True)])
