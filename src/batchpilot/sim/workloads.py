"""The standard workloads (docs/design.md), so every benchmark, simulation and load test means the same thing.

* ``conv-embed`` (encoder): arrivals of the Azure 2023 conversation trace, offset from the first row;
  input length ``clip(round(ContextTokens / 8), 4, 512)``; no output tokens.
* ``conv-llm`` (generative): prompt ``clip(round(ContextTokens / 8), 4, 1024)``, output
  ``clip(GeneratedTokens, 1, 256)`` (EOS ignored).

``load_workload`` also accepts a trace path (any format ``traces.read_trace`` knows, lengths as given).
Rounding is numpy's (half to even), the same as Python's ``round``. Real English texts of an exact
token length for conv-embed come from ``batchpilot.sim.texts`` and are re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from batchpilot.sim.texts import texts_for_lengths
from batchpilot.sim.traces import Workload, read_azure_csv, read_trace

__all__ = ["STANDARD_WORKLOADS", "Workload", "conv_embed", "conv_llm", "default_trace_path", "load_workload",
           "texts_for_lengths"]

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
