"""`tandem bench report`: rerun the benchmarks and rewrite docs/BENCHMARKS.md from them.

Each section runs its `tandem` command(s) as a subprocess, exactly as a reader would, and
writes a markdown fragment under `docs/bench/` (pictures under `docs/img/`).  BENCHMARKS.md
is then assembled from every fragment present, so `--only soak` refreshes one section and
keeps the others' last figures.  Progress goes to stderr; a full run takes ~15 minutes on
2 cores.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem_serve.ipc.process import CLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The workload of the A/B tables and of the peer comparison: 32 concurrent requests,
# 128-token prompts, exactly 64 output tokens (the figures the peers were measured with).
AB_WORKLOAD = ["--num-prompts", "128", "--input-len", "128", "--output-len", "64",
               "--max-concurrency", "32"]
PROFILE_WORKLOAD = ["--num-prompts", "160", "--input-len", "128", "--output-len", "64",
                    "--range-ratio", "0.5", "--max-concurrency", "32", "--no-progress"]


@dataclass
class Context:
    docs: str
    models: dict[str, str]  # preset -> checkpoint folder
    repeats: int
    soak_minutes: float
    fuzz_examples: int = 5000

    @property
    def img(self) -> str:
        return os.path.join(self.docs, "img")

    @property
    def frag(self) -> str:
        return os.path.join(self.docs, "bench")


def progress(msg: str) -> None:
    print(f"[bench report] {msg}", file=sys.stderr, flush=True)


def tandem(*args: str, timeout: float = 3600) -> str:
    """Run a `tandem` subcommand from the repository root; its stdout (stderr streams)."""
    cmd = [*CLI, *args]
    progress("$ tandem " + " ".join(args))
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout,
                         check=True)
    return out.stdout


def shown(args: list[str], ctx: Context) -> str:
    """The command as a reader would type it: model folders by preset, not temp paths."""
    names = {path: f"/tmp/tiny-{preset}" for preset, path in ctx.models.items()}
    return "tandem " + " ".join(shlex.quote(names.get(a, a)) for a in args)


def scrub(text: str, ctx: Context) -> str:
    """A command's output with the report's temporary model folders named by preset."""
    for preset, path in ctx.models.items():
        text = text.replace(path, f"/tmp/tiny-{preset}")
    return text


def code(*lines: str) -> str:
    return "```sh\n" + "\n".join(lines) + "\n```"


# ---------------------------------------------------------------------- sections


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
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    return "\n".join([
        f"Machine: {os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, "
        f"{'CUDA ' + str(torch.version.cuda) if torch.cuda.is_available() else 'no GPU'}; "
        f"Python {platform.python_version()}, torch {torch.__version__}.",
        f"Generated {time.strftime('%Y-%m-%d')} at commit {commit} by `tandem bench report` "
        "(`make benchmarks`); shared machines are noisy, so compare figures as ratios "
        "inside one table. Tiny checkpoints: `tandem make-tiny-model /tmp/tiny-default` "
        "(hidden 256, 4 layers, 32k vocab) and `--preset fast` (hidden 64, 2 layers)."])


def run_ab(args: list[str], *more: str, png: str = "") -> tuple[str, dict[str, Any]]:
    """`tandem bench ab ARGS MORE`: what it printed and its JSON results (the chart goes to
    `png`, else with the JSON into a scratch folder)."""
    out = tempfile.mkdtemp(prefix="tandem-report-")
    path = os.path.join(out, "ab.json")
    text = tandem(*args, *more, "--output-json", path, "--png",
                  png or os.path.join(out, "ab.png"))
    with open(path) as f:
        return text, json.load(f)


def _ab(ctx: Context, preset: str, peers: str, *extra: str) -> str:
    args = ["bench", "ab", "--model", ctx.models[preset], *AB_WORKLOAD, "--steps", "1,8",
            "--repeats", str(ctx.repeats), *extra]
    if peers:
        args += ["--peers", peers]
    text, results = run_ab(args, "--title",
                           f"Tandem A/B, {preset} preset (medians of {ctx.repeats})",
                           png=os.path.join(ctx.img, f"ab_{preset}.png"))
    head = (f"Each arm on a fresh server, the same seeded workload, medians of "
            f"{ctx.repeats} interleaved runs. 'idle % in steady decode' is the share of time "
            "the gpu worker waited for a plan while it had requests to decode (plans "
            "without prefill); 'device idle %' is over the whole run, waits for new "
            "requests included. The load generator runs on the cores the server keeps for "
            "its Python processes, never on the pinned worker's.")
    return "\n\n".join([head, code(shown(args, ctx)), text.strip(),
                        _ab_reading(results), f"![A/B, {preset} preset](img/ab_{preset}.png)"])


def _ratio(r: dict[str, dict[str, Any]], a: str, b: str, key: str) -> str:
    """Arm a's figure over arm b's, as '0.58×' ('n/a' when either is missing)."""
    if a not in r or b not in r or not r[b].get(key):
        return "n/a"
    return f"{r[a][key] / r[b][key]:.2f}×"


def _ab_reading(r: dict[str, dict[str, Any]]) -> str:
    ratio = functools.partial(_ratio, r)

    lines = [f"- async K=8 mean TPOT = {ratio('async K=8', 'sync K=1', 'mean_tpot_ms')} sync "
             f"K=1's and {ratio('async K=8', 'sync K=8', 'mean_tpot_ms')} sync K=8's (the "
             "seed measured 0.76× sync K=1 on an H100)."]
    a8 = r.get("async K=8", {})
    if "async K=8 HTTP" in r:
        lines.append(f"- Over the OpenAI-compatible HTTP API (the `openai-completions` client, "
                     f"SSE) async K=8 output throughput is "
                     f"{ratio('async K=8 HTTP', 'async K=8', 'output_throughput')} and mean "
                     f"TPOT {ratio('async K=8 HTTP', 'async K=8', 'mean_tpot_ms')} of gRPC's; "
                     "transformers serve is compared with this HTTP arm, through the same "
                     "client.")
    if "async unpaced K=8" in r:
        lines.append(f"- Paced planning: async K=8 output throughput "
                     f"{ratio('async K=8', 'async unpaced K=8', 'output_throughput')} and mean "
                     f"TTFT {ratio('async K=8', 'async unpaced K=8', 'mean_ttft_ms')} of "
                     "`--no-pace-plans`'.")
    if a8:
        lines.append(f"- async K=8: device idle in steady decode "
                     f"{a8.get('steady_idle_pct', float('nan')):.2f}%; postprocessing "
                     f"{a8.get('postproc_ms_per_plan', float('nan')):.2f} ms per plan next to "
                     f"{a8.get('forward_ms_per_plan', float('nan')):.2f} ms of forward.")
    return "\n".join(lines)


def ab_fast(ctx: Context) -> str:
    text = _ab(ctx, "fast", "", "--unpaced")
    # The baselines must be as fast as they can be: the same arms without CPU pinning, the
    # worker's torch threads on every core.
    args = ["bench", "ab", "--model", ctx.models["fast"], *AB_WORKLOAD, "--steps", "1,8",
            "--repeats", str(ctx.repeats), "--server-arg=--reserved-cpus=0"]
    unpinned, _ = run_ab(args)
    return "\n\n".join([text, "The same arms with `--reserved-cpus 0` (no pinning, torch "
                          "threads on every core), to show no baseline was slowed by the "
                          "placement:", code(shown(args, ctx)), unpinned.strip()])


def ab_default(ctx: Context) -> str:
    return _ab(ctx, "default", "transformers-serve,hf-generate", "--http")


def pacing(ctx: Context) -> str:
    """Paced planning against building plan n+1 as soon as plan n is sent, open loop."""
    args = ["bench", "ab", "--model", ctx.models["fast"], "--num-prompts", "160",
            "--input-len", "128", "--output-len", "64", "--request-rate", "20",
            "--max-concurrency", "64", "--steps", "8", "--unpaced", "--repeats",
            str(ctx.repeats)]
    text, r = run_ab(args)
    paced, unpaced = r.get("async K=8", {}), r.get("async unpaced K=8", {})
    reading = ""
    if paced.get("mean_ttft_ms") and unpaced.get("mean_ttft_ms"):
        ratio = functools.partial(_ratio, r, "async K=8", "async unpaced K=8")

        reading = (f"- Paced: mean TTFT {paced['mean_ttft_ms']:.1f} ms against "
                   f"{unpaced['mean_ttft_ms']:.1f} ms unpaced "
                   f"({ratio('mean_ttft_ms')}), mean TPOT {ratio('mean_tpot_ms')}; forward "
                   f"{paced.get('forward_ms_per_plan', float('nan')):.1f} ms per plan, idle "
                   f"in steady decode {paced.get('steady_idle_pct', float('nan')):.2f}% "
                   f"(unpaced {unpaced.get('steady_idle_pct', float('nan')):.2f}%).")
    intro = ("Poisson arrivals at 20 requests/s (open loop, so throughput is the offered "
             "load): async K=8 as served (`--pace-plans`: plan n+1 is built when the worker "
             "says plan n is ending) next to `--no-pace-plans` (plan n+1 built as soon as "
             "plan n is sent, so a request arriving during plan n waits for plan n+2). "
             "Expected gain: about one plan of TTFT, at no idle cost.")
    return "\n\n".join([intro, code(shown(args, ctx)), text.strip(), reading])


def profile(ctx: Context) -> str:
    """Async vs sync K=8 under the same load, recorded by `tandem profile`, side by side."""
    from tandem_serve.bench.ab import Arm, arm_server

    model = ctx.models["fast"]
    summaries: dict[str, dict[str, Any]] = {}
    texts: dict[str, str] = {}
    out = tempfile.mkdtemp(prefix="tandem-report-")
    for mode in ("async", "sync"):
        with arm_server(model, Arm(8, mode == "async"), []) as (_, _, port, _):
            js = os.path.join(out, f"{mode}.json")
            texts[mode] = tandem(
                "profile", "--port", str(port), "--duration", "3", "--summary-json", js,
                "--png", os.path.join(ctx.img, f"timeline_{mode}_k8.png"),
                "--output", os.path.join(out, f"{mode}_trace.json"),
                "--", "bench", "serve", "--model", model, *PROFILE_WORKLOAD)
            summaries[mode] = json.load(open(js))
    cmd = [shown(["serve", "--model", model, "--num-scheduler-steps", "8"], ctx) +
           "   # --no-async-postproc for sync", shown(
               ["profile", "--duration", "3", "--png", "timeline.png", "--output",
                "trace.json", "--", "bench", "serve", "--model", model, *PROFILE_WORKLOAD],
               ctx)]
    rows = [("device busy % of the window", "device_busy_pct"),
            ("device idle % of the window", "device_idle_pct"),
            ("gap between decode steps, mean ms", "step_gap_mean_ms"),
            ("gap between decode steps, p99 ms", "step_gap_p99_ms"),
            ("postprocessing under a device span %", "postproc_overlap_pct"),
            ("postproc lag, mean steps", "postproc_lag_steps_mean"),
            ("decode steps recorded", "num_steps")]
    table = ["| fast preset, K=8, 32 streams | async | sync |", "|---|---:|---:|"]
    for label, key in rows:
        table.append(f"| {label} | {summaries['async'][key]:.2f} | "
                     f"{summaries['sync'][key]:.2f} |")
    for role in [p["role"] for p in summaries["async"]["processes"]]:
        busy = {m: next((p["busy_pct"] for p in s["processes"] if p["role"] == role), 0.0)
                for m, s in summaries.items()}
        table.append(f"| {role} busy % | {busy['async']:.1f} | {busy['sync']:.1f} |")
    return "\n\n".join([
        "Async and sync K=8 on the fast preset under the same load, 3 s recorded by "
        "`tandem profile` (every process's spans on one clock).", code(*cmd),
        "\n".join(table),
        "![async K=8 timeline](img/timeline_async_k8.png)",
        "![sync K=8 timeline](img/timeline_sync_k8.png)",
        "<details><summary>Full summaries</summary>\n\nasync K=8:\n\n```\n" +
        texts["async"].strip() + "\n```\n\nsync K=8:\n\n```\n" + texts["sync"].strip() +
        "\n```\n</details>"])


def command_section(ctx: Context, intro: str, args: list[str], *, fenced: bool = False,
                    timeout: float = 3600) -> str:
    """The intro, the command as typed, and what it printed (`fenced`: as plain text)."""
    text = tandem(*args, timeout=timeout).strip()
    return "\n\n".join([intro, code(shown(args, ctx)),
                        f"```\n{text}\n```" if fenced else text])


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
    result = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)
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


SECTIONS: dict[str, tuple[str, Callable[[Context], str]]] = {
    "machine": ("Machine", machine),
    "ab-fast": ("Serving A/B, fast preset (`tandem bench ab`)", ab_fast),
    "ab-default": ("Serving A/B and peers, default preset (`tandem bench ab --peers`)",
                   ab_default),
    "pacing": ("Paced planning (`tandem bench ab --unpaced`)", pacing),
    "profile": ("Where the time goes: async vs sync (`tandem profile`)", profile),
    "step": ("Decode step (`tandem bench step`)", step),
    "overhead": ("What recording costs (`tandem bench step --trace`)", overhead),
    "guided": ("Guided decoding (`tandem bench step --guided`)", guided),
    "guided-serve": ("Guided decoding served (`tandem bench guided`)", guided_serve),
    "tp": ("Tensor parallelism on a CPU (`tandem bench step --tensor-parallel-size 2`)",
           tensor_parallel),
    "postproc": ("Postprocessing headroom (`tandem bench postproc`)", postproc),
    "ipc": ("Channels (`tandem bench ipc`)", ipc),
    "lora": ("LoRA adapters (`tandem bench lora`)", lora),
    "robustness": ("Robustness (`make fuzz`, `tandem bench robustness`)", robustness),
    "soak": ("Soak (`tandem bench soak`)", soak),
}
# On request: the soak (10+ minutes) and robustness (fuzzing and restarts, ~15 minutes).
DEFAULT_SECTIONS = [s for s in SECTIONS if s not in ("soak", "robustness")]


def assemble(ctx: Context) -> str:
    parts = ["# Benchmarks", "Generated by `tandem bench report`; each section shows the "
             "command that produced it."]
    for key, (title, _) in SECTIONS.items():
        path = os.path.join(ctx.frag, f"{key}.md")
        if os.path.exists(path):
            parts += [f"## {title}", open(path).read().strip()]
    return "\n\n".join(parts) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"),
                   help="folder of BENCHMARKS.md (fragments in bench/, pictures in img/)")
    p.add_argument("--only", default="",
                   help=f"comma-separated sections (default: {','.join(DEFAULT_SECTIONS)}; "
                        f"also: soak, robustness)")
    p.add_argument("--repeats", type=int, default=3, help="runs per A/B arm (medians)")
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--fuzz-examples", type=int, default=5000,
                   help="requests of the robustness section's fuzz run")


def main(args: argparse.Namespace) -> int:
    from tandem_serve.gpu_worker.tiny_model import build_tiny_model

    sections = [s for s in args.only.split(",") if s] or DEFAULT_SECTIONS
    for s in sections:
        if s not in SECTIONS:
            raise SystemExit(f"--only: unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    work = tempfile.mkdtemp(prefix="tandem-report-models-")
    models = {}
    for preset in ("default", "fast"):
        progress(f"building the tiny '{preset}' checkpoint")
        models[preset] = str(build_tiny_model(os.path.join(work, preset), preset))
    ctx = Context(os.path.abspath(args.docs), models, args.repeats, args.soak_minutes,
                  args.fuzz_examples)
    os.makedirs(ctx.img, exist_ok=True)
    os.makedirs(ctx.frag, exist_ok=True)
    for i, key in enumerate(sections, 1):
        progress(f"section {i}/{len(sections)}: {key}")
        text = scrub(SECTIONS[key][1](ctx), ctx)
        with open(os.path.join(ctx.frag, f"{key}.md"), "w") as f:
            f.write(text.strip() + "\n")
    path = os.path.join(ctx.docs, "BENCHMARKS.md")
    with open(path, "w") as f:
        f.write(assemble(ctx))
    progress(f"wrote {path}")
    return 0
