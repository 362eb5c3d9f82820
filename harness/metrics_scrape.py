"""One read of a server's Prometheus text (`GET /metrics`), summed by name and labels: what
the end-to-end tests and `tandem bench serve --replica-url` count a replica's work with."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 30.0


class Scrape:
    """One read of a Prometheus endpoint (`url`, e.g. http://127.0.0.1:PORT/metrics).

    `text` is an exposition already read: a unit test's fake scrape reads nothing.
    """

    def __init__(self, url: str, text: str | None = None) -> None:
        self.url = url
        if text is None:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
                text = r.read().decode()
        self.text = text
        self.samples = [(s.name, s.labels, s.value)
                        for f in text_string_to_metric_families(self.text) for s in f.samples]

    def total(self, name: str, **labels: str) -> float:
        """The sum over the series of `name` that carry these label values."""
        return sum(v for n, got, v in self.samples
                   if n == name and labels.items() <= got.items())

    def labels(self, name: str) -> list[dict[str, str]]:
        return [got for n, got, _ in self.samples if n == name]
