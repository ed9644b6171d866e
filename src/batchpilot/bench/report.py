"""PNG plots and one self-contained HTML report of one or several runs (PNGs embedded as base64).

Plots: latency CDF; latency vs offered rate (capacity probes when there are some, else each run cut into
windows of its schedule); throughput over time (completions per second against arrivals per second);
queue length over time (from the server's ``/metrics`` when it exposes a queue gauge).
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.bench.capacity import CapacityResult
from batchpilot.bench.records import RequestRecord, Summary
from batchpilot.bench.scrape import MetricsSeries


@dataclass
class RunData:
    """One run as the report sees it."""

    label: str
    records: list[RequestRecord]
    summary: Summary
    metrics: MetricsSeries | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _measured(run: RunData) -> list[RequestRecord]:
    return [r for r in run.records if not r.warmup]


def _finish(plt: Any, fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str,
            legend_size: int) -> Path:
    """Labels, grid, legend, save, close: the common tail of every single-axis plot here."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdf(runs: Sequence[RunData], path: Path, sla_s: float | None = None) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        lat = np.sort([r.latency_s for r in _measured(run) if r.ok])
        if lat.size:
            ax.plot(lat * 1e3, np.arange(1, lat.size + 1) / lat.size, label=f"{run.label} (P99 "
                    f"{run.summary.p99 * 1e3:.0f} ms)")
    if sla_s:
        ax.axvline(sla_s * 1e3, color="red", ls="--", lw=1, label=f"SLA {sla_s:g} s")
    ax.set_xscale("log")
    return _finish(plt, fig, ax, path, "Latency CDF", "latency (ms, log)", "fraction of requests", 8)


def _windows(run: RunData, window_s: float) -> tuple[list[float], list[float], list[float]]:
    """Per window of scheduled time: offered rate, P50 and P99 of the requests scheduled in it
    (failed requests count as infinitely late, so a window with errors shows its P99 off the chart)."""
    recs = _measured(run)
    if not recs:
        return [], [], []
    sched = np.array([r.scheduled_s for r in recs])
    lat = np.array([r.latency_s if r.ok else 1e12 for r in recs])
    rate, p50, p99 = [], [], []
    for start in np.arange(sched.min(), sched.max() + 1e-9, window_s):
        sel = (sched >= start) & (sched < start + window_s)
        if sel.sum() >= 5:
            rate.append(float(sel.sum()) / window_s)
            p50.append(float(np.percentile(lat[sel], 50)))
            p99.append(float(np.percentile(lat[sel], 99)))
    return rate, p50, p99


def plot_latency_vs_rate(runs: Sequence[RunData], path: Path, capacity: Sequence[CapacityResult] = (),
                         labels: Sequence[str] = (), sla_s: float | None = None,
                         window_s: float = 5.0) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if capacity:
        for label, cap in zip(labels or [f"run {i}" for i in range(len(capacity))], capacity, strict=False):
            pts = sorted((p.summary.offered_rps, p.summary.p50, p.summary.p99) for p in cap.probes)
            x = [p[0] for p in pts]
            line, = ax.plot(x, [p[2] * 1e3 for p in pts], "o-", label=f"{label} P99")
            ax.plot(x, [p[1] * 1e3 for p in pts], "s--", color=line.get_color(), alpha=0.6,
                    label=f"{label} P50")
    else:
        for run in runs:
            rate, p50, p99 = _windows(run, window_s)
            ax.scatter(rate, np.array(p99) * 1e3, s=14, label=f"{run.label} P99 per {window_s:g} s window")
            ax.scatter(rate, np.array(p50) * 1e3, s=8, marker="x", alpha=0.5, label=f"{run.label} P50")
    if sla_s:
        ax.axhline(sla_s * 1e3, color="red", ls="--", lw=1, label=f"SLA {sla_s:g} s")
    ax.set_yscale("log")
    return _finish(plt, fig, ax, path, "Latency vs rate", "offered rate (req/s)", "latency (ms, log)", 7)


def plot_over_time(runs: Sequence[RunData], path: Path, bin_s: float = 1.0) -> Path:
    """Top: completions/s (solid) and arrivals/s (dotted). Bottom: queue length from /metrics."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    have_queue = False
    for run in runs:
        recs = run.records
        done = np.array([r.done_s for r in recs if r.ok])
        sched = np.array([r.scheduled_s for r in recs])
        end = max(float(np.nanmax(done)) if done.size else 0.0, float(sched.max()) if sched.size else 0.0)
        edges = np.arange(0.0, end + bin_s, bin_s)
        if edges.size < 2:
            continue
        c, _ = np.histogram(done, edges)
        a, _ = np.histogram(sched, edges)
        line, = ax1.plot(edges[:-1], c / bin_s, label=f"{run.label} completed/s")
        ax1.plot(edges[:-1], a / bin_s, ":", color=line.get_color(), label=f"{run.label} arrivals/s")
        if run.metrics is not None:
            for name in run.metrics.queue_names():
                t, v = run.metrics.series(name)
                ax2.step(t, v, where="post", color=line.get_color(), label=f"{run.label} {name}")
                have_queue = True
    ax1.set_ylabel("requests / s")
    ax1.set_title("Throughput over time")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("seconds from the start of the run")
    ax2.set_ylabel("queue length")
    ax2.set_title("Queue length over time" + ("" if have_queue else " (the server exposes no queue gauge)"))
    ax2.grid(alpha=0.3)
    if have_queue:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return "-" if not math.isfinite(x) else f"{x:.4g}"
    return html.escape(str(x))


def summary_table(runs: Sequence[RunData]) -> str:
    ms = lambda x: "-" if not math.isfinite(x) else f"{x * 1e3:.1f}"  # noqa: E731
    head = ["run", "requests", "ok", "offered/s", "throughput/s", "goodput/s", "P50 ms", "P90 ms", "P99 ms",
            "P99.9 ms", "SLA", "send lag P99 ms", "errors"]
    rows = []
    for r in runs:
        s = r.summary
        rows.append([r.label, s.num_requests, s.num_ok, f"{s.offered_rps:.2f}", f"{s.throughput_rps:.2f}",
                     f"{s.goodput_rps:.2f}", ms(s.latency["p50"]), ms(s.latency["p90"]), ms(s.latency["p99"]),
                     ms(s.latency["p99.9"]), "met" if s.sla_met else "missed", ms(s.send_lag["p99"]),
                     json.dumps(s.errors) if s.errors else ""])
    return html_table(head, rows)


def html_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def write_report(out_dir: str | Path, runs: Sequence[RunData], *, title: str = "batchpilot bench",
                 capacity: Sequence[CapacityResult] = (), sla_s: float | None = None,
                 sections: Sequence[tuple[str, str]] = ()) -> Path:
    """Write the PNGs and ``report.html`` into ``out_dir``; ``sections`` are extra (heading, html) blocks."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    if runs:
        pngs.append(plot_latency_cdf(runs, out / "latency_cdf.png", sla_s))
    if runs or capacity:
        labels = [r.label for r in runs] if len(runs) == len(capacity) else []
        pngs.append(plot_latency_vs_rate(runs, out / "latency_vs_rate.png", capacity, labels, sla_s))
    if runs:
        pngs.append(plot_over_time(runs, out / "over_time.png"))
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if runs:
        parts += ["<h2>Summary</h2>", summary_table(runs)]
        for r in runs:
            parts += [f"<p><b>{html.escape(r.label)}</b>: " + html.escape(json.dumps(r.info)) + "</p>"]
            parts += [f"<p class=warn>WARNING: {html.escape(w)}</p>" for w in r.summary.warnings]
    for cap in capacity:
        parts += ["<h2>Capacity search</h2>", f"<pre>{html.escape(cap.table())}</pre>"]
    for heading, block in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", block]
    for png in pngs:
        data = base64.b64encode(png.read_bytes()).decode()
        heading = html.escape(png.stem.replace("_", " "))
        parts.append(f'<h2>{heading}</h2><img src="data:image/png;base64,{data}">')
    style = ("body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} .warn{color:#b00}")
    page = f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>" \
           f"<style>{style}</style></head><body>{''.join(parts)}</body></html>"
    path = out / "report.html"
    path.write_text(page)
    return path
