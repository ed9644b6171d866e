"""Poll a server's Prometheus ``/metrics`` during a run: queue length over time, batch sizes.

Only servers that expose ``/metrics`` in the Prometheus text format are scraped (a batchpilot server
does; a plain OpenAI-compatible one usually does not, and then the report simply has no queue plot).
Each scrape keeps every gauge sample and the ``_sum``/``_count`` of every histogram, keyed by the
sample name plus its labels, so the report can plot any queue gauge and the fidelity check can take
the mean batch size of a run as ``delta(sum) / delta(count)`` of the batch-size histogram.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUEUE_HINTS = ("queue", "waiting", "pending")


def parse_metrics(text: str, histograms: bool = False, by_model: bool = False) -> dict[str, float]:
    """Flat ``{"name{label=v,..}": value}`` of the gauges, counters and histogram sums/counts (and
    buckets, with ``histograms``). A batchpilot server labels each model's series ``model=<name>``;
    unless ``by_model``, that label is summed away: the whole server's figure, what a load generator
    measures (a ratio gauge such as padding efficiency is then only meaningful with one model)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not histograms and family.type == "histogram" and not s.name.endswith(("_sum", "_count")):
                continue  # buckets: many series, not needed for means
            labels = s.labels if by_model else {k: v for k, v in s.labels.items() if k != "model"}
            key = _key(s.name, labels)
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _key(name: str, labels: dict[str, str]) -> str:
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name


@dataclass
class MetricsSeries:
    """Scrapes in time order: ``times[i]`` (seconds from the run start) and ``values[i]``."""

    times: list[float] = field(default_factory=list)
    values: list[dict[str, float]] = field(default_factory=list)

    def names(self) -> list[str]:
        return sorted({k for v in self.values for k in v})

    def series(self, name: str) -> tuple[list[float], list[float]]:
        pts = [(t, v[name]) for t, v in zip(self.times, self.values, strict=True) if name in v]
        return [p[0] for p in pts], [p[1] for p in pts]

    def delta(self, name: str) -> float:
        """Last minus first scraped value of ``name`` (a counter's growth over the run); NaN with fewer
        than two scrapes holding it."""
        _, v = self.series(name)
        return v[-1] - v[0] if len(v) >= 2 else math.nan

    def queue_names(self) -> list[str]:
        """Gauges that look like a queue length (by name), for the queue-over-time plot."""
        return [n for n in self.names() if any(h in n.lower() for h in QUEUE_HINTS) and "token" not in n
                and not n.split("{")[0].endswith(("_sum", "_count", "_total", "_created", "_seconds"))]

    def histogram_mean(self, name: str, labels: str = "") -> float:
        """Mean of histogram ``name`` over the run: delta(sum) / delta(count), first to last scrape.
        ``labels`` as ``parse_metrics`` writes them (``route=/v1/embeddings``). A series missing from the
        first scrape did not exist yet (labelled series appear on first use): its baseline is 0."""
        suffix = f"{{{labels}}}" if labels else ""
        count, total = f"{name}_count{suffix}", f"{name}_sum{suffix}"
        if not self.values or count not in self.values[-1]:
            return math.nan
        first, last = self.values[0], self.values[-1]
        dc = last[count] - first.get(count, 0.0)
        return (last[total] - first.get(total, 0.0)) / dc if dc > 0 else math.nan

    def find(self, *hints: str) -> str | None:
        """The first histogram base name containing every hint (``find("batch", "size")``)."""
        for n in self.names():
            if n.endswith("_count") and all(h in n for h in hints):
                return n[: -len("_count")]
        return None


class MetricsScraper:
    """Background task scraping ``/metrics`` every ``interval_s`` on the load generator's own client."""

    def __init__(self, client: httpx.AsyncClient, interval_s: float) -> None:
        self.client = client
        self.interval_s = interval_s
        self.series = MetricsSeries()
        self._origin = 0.0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, client: httpx.AsyncClient, interval_s: float) -> MetricsScraper | None:
        """A running scraper, or ``None`` when the server has no Prometheus ``/metrics``."""
        self = cls(client, interval_s)
        first = await self._scrape()
        if first is None:
            return None
        self._origin = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._loop())
        return self

    def set_origin(self, t0: float) -> None:
        self._origin = t0

    async def _scrape(self) -> dict[str, float] | None:
        try:
            resp = await self.client.get("/metrics")
            if resp.status_code != 200:
                return None
            return parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError):
            return None

    async def _record(self) -> None:
        loop = asyncio.get_running_loop()
        values = await self._scrape()
        if values is not None:
            self.series.times.append(loop.time() - self._origin)
            self.series.values.append(values)

    async def _loop(self) -> None:
        while True:
            await self._record()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> MetricsSeries:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._record()  # a last scrape after the run, so histogram deltas cover all of it
        return self.series


def scrape_once(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """One synchronous read of ``/metrics`` (between runs: counters before and after one)."""
    return parse_metrics(httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s).text)
