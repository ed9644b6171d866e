"""PNG figures for a simulation run and for the tuner (matplotlib, Agg backend, imported lazily).

``plot_run`` writes ``latency_cdf.png`` (end-to-end and queue wait), ``queue_length.png`` and
``batch_size.png`` (per batch, over virtual time). ``plot_goodput`` writes the tuner's goodput-vs-rate
curves. Each function returns the paths it wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.sim.metrics import queue_length_series
from batchpilot.sim.target import DONE, SimRun


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # plotting is an optional extra
        raise ImportError("plots need matplotlib: pip install 'batchpilot[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run: SimRun, out_dir: str | Path, sla_s: float | None = None, title: str = "") -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rec, wl = run.record, run.workload
    done = np.asarray(rec.status) == DONE
    arrival = wl.arrival_s[done]
    lat = np.asarray(rec.finish_s)[done] - arrival
    wait = np.asarray(rec.dispatch_s)[done] - arrival
    title = title or wl.name
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for values, label in ((lat, "end-to-end"), (wait, "queue wait")):
        if values.size:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)
    if sla_s:
        ax.axvline(sla_s, color="grey", linestyle="--", label=f"SLA {sla_s:g} s")
    ax.axhline(0.99, color="lightgrey", linewidth=0.8)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(left=0.0)
    ax.set(xlabel="seconds", ylabel="fraction of requests", title=f"Latency CDF - {title}")
    ax.legend()
    paths.append(_save(fig, out / "latency_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(9, 3.5))
    t, q = queue_length_series(run)
    ax.step(t, q, where="post", linewidth=0.7)
    ax.set(xlabel="virtual time (s)", ylabel="requests waiting", title=f"Queue length - {title}")
    paths.append(_save(fig, out / "queue_length.png", plt))

    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.scatter(rec.b_start, rec.b_size, s=3, alpha=0.5)
    ax.set(xlabel="virtual time (s)", ylabel="batch size", title=f"Batch size - {title}")
    paths.append(_save(fig, out / "batch_size.png", plt))
    return paths


def plot_goodput(
    curves: Mapping[str, Sequence[tuple[float, float, float]]],
    out_path: str | Path,
    sla_s: float,
) -> Path:
    """``curves``: label -> [(offered req/s, P99 incl. failures in s, goodput req/s)]. Left: P99 vs rate
    with the SLA line (a config's capacity is where it crosses); right: goodput (requests finished within
    the SLA per second) vs offered rate, with the ideal y = x."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    top = 0.0
    for label, pts in curves.items():
        if not pts:
            continue
        rate, p99, good = (np.asarray(c, dtype=float) for c in zip(*sorted(pts), strict=True))
        ax1.plot(rate, np.minimum(p99, 1e3), marker="o", markersize=3, label=label)
        ax2.plot(rate, good, marker="o", markersize=3, label=label)
        top = max(top, float(rate.max()))
    ax1.axhline(sla_s, color="grey", linestyle="--", label=f"P99 SLA {sla_s:g} s")
    ax1.set_yscale("log")
    ax1.set(xlabel="offered rate (req/s)", ylabel="simulated P99 latency (s)", title="P99 vs offered rate")
    ax2.plot([0, top], [0, top], color="lightgrey", linestyle=":", label="ideal")
    ax2.set(xlabel="offered rate (req/s)", ylabel=f"goodput (req/s within {sla_s:g} s)",
            title="Goodput vs offered rate")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, Path(out_path), plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
