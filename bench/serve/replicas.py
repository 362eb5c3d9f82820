"""Per-replica counts for `tandem bench serve --replica-url URL ...`: when --base-url is a
router, what each replica behind it served, from its vLLM-named metrics (`GET URL/metrics`)
read before and after the run.

Per replica: requests finished by `finished_reason`, prompt and generation tokens, and the
prefix cache's hits over its queries (in tokens).  A router's own metrics say where it sent
requests; only the replicas know what their prefix caches saved.

The prefix-cache counters follow the scheduler's reports (every 0.2 s), so a replica is read
again until its queries have caught up with its prompt tokens (at most SETTLE_TIMEOUT_S; one
that has not is reported `settled: false`).  A replica without prefix caching never queries
it: its `vllm:cache_config_info` says so, and it is not waited for.  The baseline is read
after the warm-up has settled, so the warm-up stays out; anything else a replica serves
during the run is counted in.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem_serve.bench.serve.metrics import WIDTH
from tandem_serve.harness.metrics_scrape import Scrape

SUCCESS = "vllm:request_success_total"
PROMPT = "vllm:prompt_tokens_total"
GENERATION = "vllm:generation_tokens_total"
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"
SETTLE_TIMEOUT_S = 5.0
POLL_S = 0.1


@dataclass
class ReplicaCounts:
    """What one replica's counters moved by over the run."""

    url: str
    finished: dict[str, int]  # finished_reason -> requests
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    settled: bool = True  # the prefix-cache counters caught up before the wait ran out

    @property
    def requests(self) -> int:
        return sum(self.finished.values())

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries; None when the replica queried nothing."""
        if not self.prefix_cache_queries:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "requests": self.requests,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


def metrics_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/metrics"


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> int:
    return round(after.total(name, **labels) - before.total(name, **labels))


def finish_reasons(before: Scrape, after: Scrape) -> list[str]:
    """The `finished_reason` values either read has, in the server's order."""
    seen = [got.get("finished_reason", "") for s in (after, before) for got in s.labels(SUCCESS)]
    return list(dict.fromkeys(r for r in seen if r))


def prefix_caching(scrape: Scrape) -> bool:
    """False only when the server says its prefix cache is off (then it counts no queries)."""
    return not any(info.get("enable_prefix_caching") == "False"
                   for info in scrape.labels(CACHE_INFO))


def caught_up(before: Scrape, after: Scrape) -> bool:
    """Every prompt answered since `before` has been reported as queried (a preempted request
    is queried again on readmission, so queries may run ahead)."""
    return not prefix_caching(after) or \
        moved(before, after, QUERIES) >= moved(before, after, PROMPT)


def replica_counts(url: str, before: Scrape, after: Scrape, settled: bool = True
                   ) -> ReplicaCounts:
    """The counts between two reads of one replica's metrics."""
    return ReplicaCounts(
        url=url,
        finished={r: moved(before, after, SUCCESS, finished_reason=r)
                  for r in finish_reasons(before, after)},
        prompt_tokens=moved(before, after, PROMPT),
        generation_tokens=moved(before, after, GENERATION),
        prefix_cache_queries=moved(before, after, QUERIES),
        prefix_cache_hits=moved(before, after, HITS),
        settled=settled)


async def scrape_all(urls: Sequence[str]) -> list[Scrape]:
    """Every replica's metrics, read at once (off the event loop: urllib blocks)."""
    reads = (asyncio.to_thread(Scrape, metrics_url(u)) for u in urls)
    return list(await asyncio.gather(*reads))


async def settle(urls: Sequence[str], since: Sequence[Scrape], timeout: float,
                 poll: float = POLL_S) -> tuple[list[Scrape], list[bool]]:
    """The replicas' metrics once each one's prefix-cache queries caught up since `since`
    (or when `timeout` ran out), and which ones did."""
    deadline = time.monotonic() + timeout
    while True:
        now = await scrape_all(urls)
        done = [caught_up(b, a) for b, a in zip(since, now, strict=True)]
        if all(done) or time.monotonic() >= deadline:
            return now, done
        await asyncio.sleep(poll)


class ReplicaWatch:
    """The replicas' metrics at a run's start and end; with no replicas it reads nothing."""

    def __init__(self, urls: Sequence[str], timeout: float = SETTLE_TIMEOUT_S) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.before: list[Scrape] = []

    async def start(self) -> None:
        """The baseline, read before any warm-up."""
        if self.urls:
            self.before = await scrape_all(self.urls)

    async def after_warmup(self) -> None:
        """Move the baseline past the warm-up, once its prompts were reported as queried."""
        if self.urls:
            self.before, _ = await settle(self.urls, self.before, self.timeout)

    async def finish(self) -> list[ReplicaCounts]:
        if not self.urls:
            return []
        after, settled = await settle(self.urls, self.before, self.timeout)
        return [replica_counts(*args) for args in
                zip(self.urls, self.before, after, settled, strict=True)]


def summary(counts: Sequence[ReplicaCounts]) -> dict[str, Any]:
    """The result JSON's part: `replicas`, one dict per --replica-url, in their order."""
    return {"replicas": [c.as_json() for c in counts]}


def _line(label: str, value: Any) -> str:
    shown = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {shown:<10}"


def _replica_lines(i: int, r: dict[str, Any], all_requests: int) -> list[str]:
    share = 100.0 * r["requests"] / all_requests if all_requests else None
    rate = r["prefix_cache_hit_rate"]
    lines = [f"{f' Replica {i}: ' + r['url'] + ' ':-^{WIDTH}}",
             _line("Requests finished:", r["requests"]),
             *(_line(f"  finished_reason={reason}:", n) for reason, n in r["finished"].items()),
             _line("Share of all replicas' requests (%):", share),
             _line("Prompt tokens:", r["prompt_tokens"]),
             _line("Generation tokens:", r["generation_tokens"]),
             _line("Prefix cache queries (tokens):", r["prefix_cache_queries"]),
             _line("Prefix cache hits (tokens):", r["prefix_cache_hits"]),
             _line("Prefix cache hit rate (%):", None if rate is None else 100.0 * rate)]
    if not r["settled"]:
        lines.append("  (its prefix-cache queries had not caught up with its prompts)")
    return lines


def format_summary(result: dict[str, Any]) -> str:
    """The per-replica block printed under vLLM's result block."""
    replicas = result["replicas"]
    total = sum(r["requests"] for r in replicas)
    lines = [line for i, r in enumerate(replicas, 1) for line in _replica_lines(i, r, total)]
    lines.append("=" * WIDTH)
    return "\n".join(lines)
