"""The row counts a step's dense layers run fastest at, measured on the runner's own weights.

Every token of a step goes through the dense layers as one ``[T, D]`` matrix (``model_runner``). A
matrix multiply's time is not monotone in its row count: the BLAS kernels work in tiles of rows,
and on an AMD EPYC in float32 a decode step of the tiny Llama took 13.87 ms with 3 sequences and
11.87 ms with 4, 16.07 ms with 7 and 15.33 ms with 8 (context 256, exact rows:
``benchmarks/llm_step_layout.py``). No step model linear in the sequences prices both 3 and 4.

``RowPlan.measure`` times the matmuls every token row pays (qkv, o, gate_up, down of every layer: all
of them, so the weights stream from memory as in a step, where one layer's alone would stay in the
caches and misjudge one row, a matrix x vector, against four) for each row count up to ``MAX_ROWS +
LOOKAHEAD``, and ``rows(t)`` is the count the runner pads a step of ``t`` rows to: the cheapest count
in ``[t, t + LOOKAHEAD]`` when it is at least ``MARGIN`` faster than ``t`` itself, else ``t``. The
padding rows are computed and discarded (``model_runner``: never written to the KV cache, never
attended to, never sampled). Above ``MAX_ROWS`` (mostly steps with a prefill chunk, where a few rows
are a small share) rows are not padded. ``RowPlan()`` pads nothing: a runner built without a plan
runs its exact row counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_ROWS = 32  # padded up to here (decodes and short chunks: where a tile's rows are a large share)
LOOKAHEAD = 3  # at most this many padding rows
MARGIN = 0.03  # pad only when the padded count is at least this much faster
REPEATS = 3  # timed runs per row count (median); one untimed run first


@dataclass(frozen=True)
class RowPlan:
    """``pad_to[t]``: the rows a step of ``t`` token rows runs (``t < len(pad_to)``); ``t`` beyond."""

    pad_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [t for t, p in enumerate(self.pad_to) if p < t]
        if bad:
            t = bad[0]
            raise ValueError(f"row plan: pad_to[{t}] = {self.pad_to[t]} is fewer rows than {t}")

    def rows(self, t: int) -> int:
        return self.pad_to[t] if 0 <= t < len(self.pad_to) else t

    def padded(self) -> dict[int, int]:
        """The counts that are padded, and to what (for logs and the profile's meta)."""
        return {t: p for t, p in enumerate(self.pad_to) if p != t}

    @classmethod
    def from_times(cls, seconds: Sequence[float], max_rows: int = MAX_ROWS, lookahead: int = LOOKAHEAD,
                   margin: float = MARGIN) -> RowPlan:
        """The plan from ``seconds[t]``, the dense layers' time at ``t`` rows (``seconds[0]`` unused),
        known up to ``max_rows + lookahead`` at least (module docstring)."""
        if len(seconds) < max_rows + lookahead + 1:
            raise ValueError(f"row plan: {len(seconds)} timings, need {max_rows + lookahead + 1}")
        pad_to = [0]
        for t in range(1, max_rows + 1):
            best = min(range(t, t + lookahead + 1), key=lambda r: (seconds[r], r))
            pad_to.append(best if seconds[best] < (1.0 - margin) * seconds[t] else t)
        return cls(tuple(pad_to))

    @classmethod
    def measure(cls, weights: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                max_rows: int = MAX_ROWS, lookahead: int = LOOKAHEAD, repeats: int = REPEATS) -> RowPlan:
        """Time ``x @ w.T`` for every ``w`` of ``weights`` (the dense matrices, ``[out, in]``)
        at each row count, round-robin over the counts ``repeats`` times (a drift in the machine's speed
        then moves every count alike), and plan from the medians."""
        counts = range(1, max_rows + lookahead + 1)
        gen = torch.Generator(device="cpu").manual_seed(0)
        width = max(int(w.shape[1]) for w in weights)
        source = torch.randn(counts[-1], width, generator=gen).to(device, dtype)
        inputs = [[source[:t, : int(w.shape[1])].contiguous() for w in weights] for t in counts]
        runs: list[list[float]] = [[] for _ in counts]
        with torch.inference_mode():
            for xs in inputs:
                _matmuls(xs, weights)
            for _ in range(repeats):
                for xs, times in zip(inputs, runs, strict=True):
                    _sync(device)
                    t0 = time.perf_counter()
                    _matmuls(xs, weights)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
        medians = [0.0] + [sorted(t)[len(t) // 2] for t in runs]
        return cls.from_times(medians, max_rows, lookahead)


def _matmuls(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    for x, w in zip(xs, weights, strict=True):
        x @ w.T


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
