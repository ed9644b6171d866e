"""Per-request records of a load test and the summary computed from them.

One ``RequestRecord`` per replayed request, all times in seconds from the run's start (``t0``, the
instant the first request was scheduled for). Latency is measured from the moment the request was
actually handed to the HTTP client (``sent_s``); ``send_lag_s = sent_s - scheduled_s`` is how late the
generator itself was, reported separately so a lagging client cannot hide behind the server's numbers.

The summary is a pure function of the records (``summarize(read_csv(path))`` reproduces it), so a run
can be re-analysed, compared or plotted without replaying it.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
LAG_WARN_S = 0.010  # a generator more than 10 ms late at p99 is not replaying the schedule faithfully


@dataclass(slots=True)
class RequestRecord:
    """One replayed request. ``status`` is the HTTP status, 0 for a transport error (see ``error``)."""

    index: int  # row of the replayed workload slice
    scheduled_s: float
    input_tokens: int
    output_tokens: int = 0  # asked for (max_tokens) on completions; 0 for embeddings
    sent_s: float = math.nan
    done_s: float = math.nan
    status: int = 0
    latency_s: float = math.nan  # done - sent
    ttft_s: float = math.nan  # streams: first token - sent
    tokens_received: int = 0
    warmup: bool = False
    error: str = ""
    itl_s: list[float] = field(default_factory=list)  # streams: gaps between consecutive tokens
    # the server's own split of the request (its Server-Timing header; NaN when it sends none); for
    # streams, of the first token (the headers leave with it):
    server_tokenize_s: float = math.nan  # handler start -> tokens ready (incl. the tokenizer thread's queue)
    # submitted to the Batcher -> every input's result back; streams: the engine's TTFT
    server_batcher_s: float = math.nan
    server_app_s: float = math.nan  # handler start -> response body ready; streams: first token on the loop
    arm: str = ""  # the server's X-Batchpilot-Arm: which arm answered (servers with arms)
    tenant: str = ""  # whose request it was (a multi-tenant replay, ``sim.tenants``)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def send_lag_s(self) -> float:
        return self.sent_s - self.scheduled_s


_CSV_FIELDS = [f.name for f in fields(RequestRecord)]
_SERVER_TIMING = ("server_tokenize_s", "server_batcher_s", "server_app_s")  # absent from older CSVs


def write_csv(records: Iterable[RequestRecord], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*_CSV_FIELDS, "send_lag_s"])
        for r in records:
            row: list[Any] = []
            for name, value in asdict(r).items():
                if name == "itl_s":
                    row.append(";".join(f"{x:.6f}" for x in value))
                elif isinstance(value, float):
                    row.append(f"{value:.6f}" if math.isfinite(value) else "")
                elif isinstance(value, bool):
                    row.append(int(value))
                else:
                    row.append(value)
            lag = r.send_lag_s
            row.append(f"{lag:.6f}" if math.isfinite(lag) else "")
            w.writerow(row)


def read_csv(path: str | Path) -> list[RequestRecord]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            num = lambda key, row=row: float(row[key]) if row[key] else math.nan  # noqa: E731
            out.append(RequestRecord(
                index=int(row["index"]), scheduled_s=num("scheduled_s"),
                input_tokens=int(row["input_tokens"]),
                output_tokens=int(row["output_tokens"]), sent_s=num("sent_s"), done_s=num("done_s"),
                status=int(row["status"]), latency_s=num("latency_s"), ttft_s=num("ttft_s"),
                tokens_received=int(row["tokens_received"]), warmup=bool(int(row["warmup"])),
                error=row["error"], itl_s=[float(x) for x in row["itl_s"].split(";") if x],
                **{k: num(k) for k in _SERVER_TIMING if row.get(k)}, arm=row.get("arm") or "",
                tenant=row.get("tenant") or "",
            ))
    return out


def percentiles(values: Sequence[float] | np.ndarray, ps: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """``{"p50": .., "p99.9": ..}``; NaN for an empty sample (not 0: no data is not a fast server)."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    return {f"p{p:g}": (float(np.percentile(arr, p)) if arr.size else math.nan) for p in ps}


@dataclass
class Summary:
    """What one run measured (warm-up requests excluded). Rates are per second of the measured window."""

    num_requests: int
    num_ok: int
    num_warmup: int
    duration_s: float  # first measured scheduled time .. last measured completion
    offered_rps: float  # measured requests / span of their scheduled times
    throughput_rps: float  # successful requests / duration
    goodput_rps: float  # successful requests within the SLA / duration
    sla_s: float
    sla_met: bool  # P99 latency <= sla_s with no errors beyond ``max_error_frac``
    latency: dict[str, float]
    latency_mean_s: float
    latency_max_s: float
    send_lag: dict[str, float]
    send_lag_max_s: float
    errors: dict[str, int]  # "503" -> count, "transport:ReadTimeout" -> count
    ttft: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)  # per-request mean time per output token
    itl: dict[str, float] = field(default_factory=dict)  # every inter-token gap
    output_tokens_per_s: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def p50(self) -> float:
        return self.latency["p50"]

    @property
    def p99(self) -> float:
        return self.latency["p99"]


def summarize(records: Sequence[RequestRecord], sla_s: float = 1.0, max_error_frac: float = 0.0) -> Summary:
    """Summarise the non-warm-up records. A failed request counts against the SLA like a late one: a
    server that sheds load with 503s must not look faster than one that serves it."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    lat = np.array([r.latency_s for r in ok], dtype=float)
    n = len(measured)
    if measured:
        sched = np.array([r.scheduled_s for r in measured])
        done = np.array([r.done_s for r in measured])
        start = float(sched.min())
        end = float(np.nanmax(done)) if np.isfinite(done).any() else float(sched.max())
        duration = max(end - start, 1e-9)
        span = float(sched.max() - sched.min())
        offered = (n - 1) / span if n > 1 and span > 0 else 0.0
    else:
        duration, offered = 0.0, 0.0
    errors = Counter(str(r.status) if r.status else f"transport:{r.error.split(':')[0]}"
                     for r in measured if not r.ok)
    within = int((lat <= sla_s).sum())
    # P99 over *all* measured requests, failed ones counted as infinitely late
    all_lat = np.array([r.latency_s if r.ok else 1e12 for r in measured], dtype=float)  # 1e12: "never"
    p99_all = float(np.percentile(all_lat, 99)) if n else math.nan
    err_frac = (n - len(ok)) / n if n else 0.0
    lags = np.array([r.send_lag_s for r in measured if math.isfinite(r.sent_s)], dtype=float)
    lag_pct = percentiles(lags, (50.0, 99.0))
    s = Summary(
        num_requests=n, num_ok=len(ok), num_warmup=len(records) - n, duration_s=duration,
        offered_rps=offered,
        throughput_rps=len(ok) / duration if duration else 0.0,
        goodput_rps=within / duration if duration else 0.0,
        sla_s=sla_s, sla_met=bool(n and p99_all <= sla_s and err_frac <= max_error_frac),
        latency=percentiles(lat), latency_mean_s=float(lat.mean()) if lat.size else math.nan,
        latency_max_s=float(lat.max()) if lat.size else math.nan,
        send_lag=lag_pct, send_lag_max_s=float(lags.max()) if lags.size else math.nan,
        errors=dict(sorted(errors.items())),
    )
    streamed = [r for r in ok if math.isfinite(r.ttft_s)]
    if streamed:
        s.ttft = percentiles([r.ttft_s for r in streamed])
        s.tpot = percentiles([(r.latency_s - r.ttft_s) / (r.tokens_received - 1)
                              for r in streamed if r.tokens_received > 1])
        s.itl = percentiles([g for r in streamed for g in r.itl_s])
        s.output_tokens_per_s = sum(r.tokens_received for r in streamed) / duration if duration else 0.0
    if lags.size and lag_pct["p99"] > LAG_WARN_S:
        s.warnings.append(
            f"the load generator fell behind its schedule: send lag p99 {lag_pct['p99'] * 1e3:.1f} ms, "
            f"max {s.send_lag_max_s * 1e3:.1f} ms (CPU shared with the server? fewer requests per second?)")
    return s


def format_summary(s: Summary, label: str = "") -> str:
    """A few human lines (the CLI prints them; the HTML report has the full table)."""
    ms = lambda x: f"{x * 1e3:.1f}" if math.isfinite(x) else "-"  # noqa: E731
    head = f"{label}: " if label else ""
    lines = [
        f"{head}{s.num_requests} requests ({s.num_warmup} warm-up excluded), {s.num_ok} ok, "
        f"offered {s.offered_rps:.2f} req/s, throughput {s.throughput_rps:.2f} req/s, "
        f"goodput {s.goodput_rps:.2f} req/s (latency <= {s.sla_s:g} s)",
        "  latency ms  " + "  ".join(f"{k} {ms(v)}" for k, v in s.latency.items())
        + f"  mean {ms(s.latency_mean_s)}  max {ms(s.latency_max_s)}",
        f"  SLA P99 <= {s.sla_s:g} s: {'met' if s.sla_met else 'MISSED'}; send lag ms p50 "
        f"{ms(s.send_lag['p50'])} p99 {ms(s.send_lag['p99'])} max {ms(s.send_lag_max_s)}",
    ]
    if s.ttft:
        lines.append("  TTFT ms  " + "  ".join(f"{k} {ms(v)}" for k, v in s.ttft.items())
                     + "; TPOT ms  " + "  ".join(f"{k} {ms(v)}" for k, v in s.tpot.items()))
        lines.append("  ITL ms  " + "  ".join(f"{k} {ms(v)}" for k, v in s.itl.items())
                     + f"; output {s.output_tokens_per_s:.1f} tok/s")
    if s.errors:
        lines.append("  errors: " + ", ".join(f"{k} x{v}" for k, v in s.errors.items()))
    lines += [f"  WARNING: {w}" for w in s.warnings]
    return "\n".join(lines)


def by_tenant(records: Sequence[RequestRecord], sla_s: float = 1.0) -> dict[str, Summary]:
    """``summarize`` of each tenant's records (a multi-tenant replay), by tenant name."""
    names = sorted({r.tenant for r in records})
    return {name: summarize([r for r in records if r.tenant == name], sla_s) for name in names}
