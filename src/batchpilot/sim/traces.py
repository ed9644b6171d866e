"""Arrival lists: the ``Workload`` every driver replays, and readers for the trace formats we meet.

A workload is columns, not objects: sorted arrival seconds (first row at 0) and per-row input tokens,
output tokens and priority, as numpy arrays. The simulator indexes them; the load generator iterates
``rows()``. Formats read here:

* Azure LLM inference trace CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens`` (timestamps are
  datetimes like ``2023-11-16 18:15:46.6805900`` or plain seconds).
* Mooncake JSONL: one object per line with ``timestamp`` (milliseconds), ``input_length``,
  ``output_length``.
* batchpilot CSV: ``arrival_s, input_tokens, output_tokens[, priority]`` (what ``to_csv`` writes).

Load is changed by scaling time (``scale_rate``), never by dropping rows; runs use contiguous slices.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np


class Arrival(NamedTuple):
    """One row as plain data (what the load generator sends)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    priority: int


@dataclass(frozen=True)
class Workload:
    """Rows sorted by arrival; ``arrival_s[0] == 0`` after loading or slicing. ``tenant``: each row's
    tenant (strings; None: every row is the default tenant's), as ``sim.tenants.tenant_mix`` builds it."""

    name: str
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    priority: np.ndarray
    tenant: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for col in ("input_tokens", "output_tokens", "priority", "tenant"):
            if getattr(self, col) is not None and len(getattr(self, col)) != n:
                raise ValueError(f"workload {self.name!r}: column {col} has {len(getattr(self, col))} rows, "
                                 f"arrival_s has {n}; give every column the same length")
        if n and (np.diff(self.arrival_s) < 0).any():
            raise ValueError(f"workload {self.name!r}: arrival_s must be sorted ascending")

    @classmethod
    def from_columns(
        cls,
        name: str,
        arrival_s: np.ndarray | list[float],
        input_tokens: np.ndarray | list[int],
        output_tokens: np.ndarray | list[int] | None = None,
        priority: np.ndarray | list[int] | None = None,
    ) -> Workload:
        """Sort by arrival (stable, so equal times keep file order) and offset the first row to 0."""
        t = np.asarray(arrival_s, dtype=float)
        n = len(t)
        cols = [np.asarray(c if c is not None else np.zeros(n), dtype=np.int64)
                for c in (input_tokens, output_tokens, priority)]
        order = np.argsort(t, kind="stable")
        t = t[order]
        t = t - t[0] if n else t
        return cls(name, t, *(c[order] for c in cols))

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span of the arrivals."""
        return (len(self) - 1) / self.duration_s if len(self) > 1 and self.duration_s > 0 else 0.0

    def scale_rate(self, k: float) -> Workload:
        """``k`` times the request rate: every arrival time divided by ``k``; no row is dropped."""
        if not k > 0:
            raise ValueError(f"rate scale must be > 0, got {k}")
        return Workload(f"{self.name}x{k:g}", self.arrival_s / k, self.input_tokens, self.output_tokens,
                        self.priority, self.tenant)

    def slice(self, start: int = 0, count: int | None = None) -> Workload:
        """Contiguous rows ``[start, start + count)``, re-offset so the first arrives at 0."""
        if start < 0 or start >= max(len(self), 1):
            raise ValueError(f"slice start {start} is outside the workload's {len(self)} rows")
        end = len(self) if count is None else min(len(self), start + count)
        t = self.arrival_s[start:end]
        return Workload(self.name, t - t[0], self.input_tokens[start:end], self.output_tokens[start:end],
                        self.priority[start:end], None if self.tenant is None else self.tenant[start:end])

    def rows(self) -> Iterator[Arrival]:
        for t, i, o, p in zip(self.arrival_s.tolist(), self.input_tokens.tolist(),
                              self.output_tokens.tolist(), self.priority.tolist(), strict=True):
            yield Arrival(t, i, o, p)

    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["arrival_s", "input_tokens", "output_tokens", "priority"])
            for row in self.rows():
                w.writerow([f"{row.arrival_s:.6f}", row.input_tokens, row.output_tokens, row.priority])


def _parse_times(values: list[str]) -> np.ndarray:
    """Plain seconds if they parse as floats, else ISO-like datetimes (nanosecond precision)."""
    try:
        return np.array([float(v) for v in values], dtype=float)
    except ValueError:
        stamps = np.array([v.strip() for v in values], dtype="datetime64[ns]")
        return (stamps - stamps.min()).astype(np.int64) / 1e9


def read_azure_csv(path: str | Path, name: str | None = None) -> Workload:
    """Azure LLM inference trace (2023/2024 schema): input = ContextTokens, output = GeneratedTokens."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = [(r["TIMESTAMP"], r["ContextTokens"], r["GeneratedTokens"]) for r in reader]
    if not rows:
        raise ValueError(f"{path}: no rows")
    ts, ctx, gen = zip(*rows, strict=True)
    return Workload.from_columns(name or Path(path).stem, _parse_times(list(ts)),
                                 [int(x) for x in ctx], [int(x) for x in gen])


def read_mooncake_jsonl(path: str | Path, name: str | None = None) -> Workload:
    """Mooncake traces: ``timestamp`` in milliseconds, ``input_length``, ``output_length`` per line."""
    t, inp, out = [], [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                t.append(float(obj["timestamp"]) / 1000.0)
                inp.append(int(obj["input_length"]))
                out.append(int(obj["output_length"]))
    if not t:
        raise ValueError(f"{path}: no rows")
    return Workload.from_columns(name or Path(path).stem, t, inp, out)


def read_batchpilot_csv(path: str | Path, name: str | None = None) -> Workload:
    """Our own format: ``arrival_s, input_tokens, output_tokens[, priority]``."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return Workload.from_columns(
        name or Path(path).stem,
        [float(r["arrival_s"]) for r in rows],
        [int(r["input_tokens"]) for r in rows],
        [int(r.get("output_tokens") or 0) for r in rows],
        [int(r.get("priority") or 0) for r in rows],
    )


def read_trace(path: str | Path, name: str | None = None) -> Workload:
    """Pick the reader from the file: ``.jsonl`` is Mooncake, a CSV by its header."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return read_mooncake_jsonl(p, name)
    with open(p, newline="") as f:
        header = [h.strip() for h in next(csv.reader(f), [])]
    if "TIMESTAMP" in header:
        return read_azure_csv(p, name)
    if "arrival_s" in header:
        return read_batchpilot_csv(p, name)
    raise ValueError(f"{path}: unknown trace format (header {header}); expected an Azure CSV "
                     "(TIMESTAMP,ContextTokens,GeneratedTokens), a batchpilot CSV (arrival_s,input_tokens,"
                     "output_tokens[,priority]) or Mooncake JSONL")


# The standard workloads (docs/design.md), so every benchmark, simulation and load test means the same thing.
#
# * ``conv-embed`` (encoder): arrivals of the Azure 2023 conversation trace, offset from the first row;
#   input length ``clip(round(ContextTokens / 8), 4, 512)``; no output tokens.
# * ``conv-llm`` (generative): prompt ``clip(round(ContextTokens / 8), 4, 1024)``, output
#   ``clip(GeneratedTokens, 1, 256)`` (EOS ignored).
#
# ``load_workload`` also accepts a trace path (any format ``traces.read_trace`` knows, lengths as given).
# Rounding is numpy's (half to even), the same as Python's ``round``. Real English texts of an exact
# token length for conv-embed come from ``batchpilot.models.texts`` and are re-exported here.


TRACE_FILE = "azure_llm_2023_conv.csv"
STANDARD_WORKLOADS = ("conv-embed", "conv-llm")


def default_trace_path() -> Path:
    """``$BATCHPILOT_TRACE``, else the copy bundled with the package (``batchpilot/data``), else
    ``../shared/traces/`` next to the checkout or the working directory."""
    env = os.environ.get("BATCHPILOT_TRACE")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[1] / "data" / TRACE_FILE)
    repo = Path(__file__).resolve().parents[3]
    candidates += [repo.parent / "shared" / "traces" / TRACE_FILE, Path.cwd().parent / "shared" / "traces" /
                   TRACE_FILE, Path.cwd() / "traces" / TRACE_FILE]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"the Azure conversation trace {TRACE_FILE} was not found in "
                            f"{[str(c) for c in candidates]}; set BATCHPILOT_TRACE to its path")


def conv_embed(path: str | Path | None = None) -> Workload:
    raw = read_azure_csv(path or default_trace_path())
    lengths = np.clip(np.round(raw.input_tokens / 8), 4, 512).astype(np.int64)
    return Workload("conv-embed", raw.arrival_s, lengths, np.zeros_like(lengths), raw.priority)


def conv_llm(path: str | Path | None = None) -> Workload:
    raw = read_azure_csv(path or default_trace_path())
    prompt = np.clip(np.round(raw.input_tokens / 8), 4, 1024).astype(np.int64)
    output = np.clip(raw.output_tokens, 1, 256).astype(np.int64)
    return Workload("conv-llm", raw.arrival_s, prompt, output, raw.priority)


def load_workload(
    name_or_path: str | Path,
    rate_scale: float = 1.0,
    start: int = 0,
    count: int | None = None,
    trace: str | Path | None = None,
) -> Workload:
    """A standard workload by name (optionally from another trace file of the Azure schema) or a trace
    file, cut to the contiguous rows ``[start, start + count)`` and sped up ``rate_scale`` times."""
    key = str(name_or_path)
    if key == "conv-embed":
        wl = conv_embed(trace)
    elif key == "conv-llm":
        wl = conv_llm(trace)
    elif Path(key).is_file():
        wl = read_trace(key)
    else:
        names = ", ".join(STANDARD_WORKLOADS)
        raise ValueError(f"unknown workload {key!r}: use one of {names} or a trace file")
    if start or count is not None:
        wl = wl.slice(start, count)
    return wl.scale_rate(rate_scale) if rate_scale != 1.0 else wl
