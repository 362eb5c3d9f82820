"""The serving sections of `tandem bench report`: the A/B tables (fast preset; default
preset with its peers), paced planning, and where the time goes (`tandem profile`)."""
from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Any

from tandem_serve.bench.report.commands import Context, code, shown, tandem
from tandem_serve.harness.arms import Arm, arm_server

# The workload of the A/B tables and of the peer comparison: 32 concurrent requests,
# 128-token prompts, exactly 64 output tokens (the figures the peers were measured with).
AB_WORKLOAD = ["--num-prompts", "128", "--input-len", "128", "--output-len", "64",
               "--max-concurrency", "32"]
PROFILE_WORKLOAD = ["--num-prompts", "160", "--input-len", "128", "--output-len", "64",
                    "--range-ratio", "0.5", "--max-concurrency", "32", "--no-progress"]


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
    model = ctx.models["fast"]
    summaries: dict[str, dict[str, Any]] = {}
    texts: dict[str, str] = {}
    out = tempfile.mkdtemp(prefix="tandem-report-")
    for mode in ("async", "sync"):
        with arm_server(model, Arm(8, mode == "async"), []) as served:
            js = os.path.join(out, f"{mode}.json")
            texts[mode] = tandem(
                "profile", "--port", str(served.port), "--duration", "3", "--summary-json", js,
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


def mixed(ctx: Context) -> str:
    """Mixed steps against `--prefill-phase`: decoding streams while long prompts arrive
    (`bench stall`, on the worker's CPU clock), then Poisson arrivals of long prompts."""
    stall = ["bench", "stall", "--model", ctx.models["default"], "--in-process",
             "--budgets", "96,128,160,224", "--rounds", "3"]
    arrivals = ["bench", "ab", "--model", ctx.models["default"], "--steps", "8",
                "--input-len", "1024", "--output-len", "128", "--num-prompts", "24",
                "--request-rate", "0.75", "--max-concurrency", "64", "--prefill-phase",
                "--repeats", str(ctx.repeats)]
    tables = tandem(*stall).strip().split("\n\n")
    stall_text = tables[0]  # every arm and round; the per-budget ratio tables are left out
    ab_text, _ = run_ab(arrivals)
    intro = ("Prefill chunks inside the K decode steps (the default) against `--prefill-phase` "
             "(each plan's chunks in a forward of their own before its steps), same server "
             "otherwise. First the stall scenario: 4 streams decode while 6 prompts of ~1,000 "
             "tokens arrive 1.2 s apart, K=8; the scheduler and runner run in one process on "
             "a clock of the worker thread's CPU time, so a neighbour's job on a shared host "
             "does not count as a stall. One mixed arm per per-step budget (160 is the CPU "
             "default).")
    budgets = ("Each budget against `--prefill-phase`, medians of within-round ratios, and the "
               "TTFT ratio its worst gap allows at best (docs/DESIGN.md, section 14):")
    second = ("Then arrivals: Poisson, 0.75 requests/s of 1,024-token prompts with 128 output "
              "tokens, every arm on a fresh server, arms interleaved; the last lines are each "
              "arm's figures over its `--prefill-phase` twin's.")
    return "\n\n".join([intro, code(shown(stall, ctx)), stall_text, budgets, tables[-1],
                        second, code(shown(arrivals, ctx)), ab_text.strip()])
