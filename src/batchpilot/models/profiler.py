"""Measure an encoder over a grid of batch shapes and fit the core cost model (the library behind
``batchpilot profile``, ``profile/cli.py``, and the server's start-up profile).

For each (batch size n, length L) of the grid (its lengths: ``grid_lengths``), cheapest first: one
untimed warm-up call; then ``repeats`` rounds, each timing one ``prepare + run`` call of every shape
through the executor itself (the same path the server takes, same padding mode); a point's latency is
the median of its calls.
Round-robin, so that the CPU's speed drifting during the profile scales every shape alike. Peak
memory comes from one more call under ``models.device.peak_memory_bytes`` (docs/profiler.md says what
it counts). Features come from ``BatchShape.padded`` (or ``.ragged`` for padding "none"), and
``CostModel.fit`` turns the points into the model that policies, admission and the simulator share.

Accuracy is reported two ways: leave-one-out over the grid (each point predicted by a model fitted
without it) and, with ``holdout``, seeded mixed-length batches the grid never saw, predicted by the
model fitted on the whole grid.

torch is imported lazily: ``batchpilot --help`` must work without it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from batchpilot.core.costmodel import (
    ENCODER_FEATURES,
    PROFILED_ENCODER_FEATURES,
    BatchShape,
    CostModel,
    ProfilePoint,
)

QUICK_BATCH_SIZES = (1, 4, 16)
QUICK_LENGTHS = (16, 64, 256, 512)
# `batchpilot profile`'s grid: every length doubling and batch sizes up to 16 (29 shapes under the 4096-token
# cap, ~80 s for MiniLM on one CPU core). The quick grid (12 shapes, the server's start-up profile) fitted
# MiniLM with a 14% median / 55% max held-out error; this one with 5% / 8% (docs/profiler.md).
STANDARD_BATCH_SIZES = (1, 2, 4, 8, 16)
STANDARD_LENGTHS = (16, 32, 64, 128, 256, 512)
MIX_SPREAD = 0.25  # a grid batch's lengths spread over L * (1 +- this) (grid_lengths)
# with fewer points (a budget-cut or custom grid) the fit keeps the linear features: tokens_sq needs
# shapes from hundreds to thousands of tokens beside the four it shares them with
MIN_POINTS_TOKENS_SQ = 10


def fitted_features(points: int) -> tuple[str, ...]:
    """The encoder features a profile of ``points`` shapes is fitted on (docs/profiler.md)."""
    return PROFILED_ENCODER_FEATURES if points >= MIN_POINTS_TOKENS_SQ else ENCODER_FEATURES


@dataclass
class Measurement:
    """One measured batch: its shape, the median latency over repeats, and peak memory."""

    n: int
    lengths: list[int]
    padded_len: int
    padding: str
    latency_s: float
    prepare_s: float
    samples_s: list[float]
    memory_bytes: float
    features: dict[str, float]

    def point(self) -> ProfilePoint:
        return ProfilePoint(self.features, self.latency_s, self.memory_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["length"] = max(self.lengths)
        if len(set(self.lengths)) == 1:
            d["lengths"] = self.lengths[:1]  # uniform grid point: one length says it all
        return d


def _ids(executor: Any, length: int, rng: random.Random) -> list[int]:
    """A seeded input of exactly ``length`` tokens, special tokens included."""
    body = max(length - executor.num_special_tokens, 1)
    return executor.tokenize_ids([[rng.randrange(1000, executor.vocab_size) for _ in range(body)]])[0]


def measure(executor: Any, lengths: list[int], padding: str, repeats: int, rng: random.Random,
            memory: bool = True) -> Measurement:
    """Time ``prepare + run`` of one batch with these input lengths (median of ``repeats`` after one
    warm-up call) and measure its peak memory."""
    shape = TimedBatch(executor, lengths, padding, rng, memory)
    for _ in range(repeats):
        shape.time_once()
    return shape.measurement()


class TimedBatch:
    """One batch of the grid: built, warmed up (its first call allocates) and its memory measured on
    creation; ``time_once`` adds one timed ``prepare + run`` sample."""

    def __init__(self, executor: Any, lengths: list[int], padding: str, rng: random.Random,
                 memory: bool) -> None:
        from batchpilot.models.device import peak_memory_bytes
        from batchpilot.models.encoder import make_batch

        self.executor, self.lengths, self.padding = executor, list(lengths), padding
        self.batch = make_batch([_ids(executor, n, rng) for n in lengths], padding, executor.max_length)
        t0 = time.perf_counter()
        executor.run(executor.prepare(self.batch))  # warm-up: first call of a new shape allocates
        self.warmup_s = time.perf_counter() - t0
        self.memory = peak_memory_bytes(lambda: executor.run(executor.prepare(self.batch)),
                                        executor.device) if memory else 0.0
        self.total: list[float] = []
        self.prep: list[float] = []

    def time_once(self) -> None:
        t0 = time.perf_counter()
        prepared = self.executor.prepare(self.batch)
        t1 = time.perf_counter()
        self.executor.run(prepared)
        self.total.append(time.perf_counter() - t0)
        self.prep.append(t1 - t0)

    def measurement(self) -> Measurement:
        shape = self.batch.shape
        return Measurement(len(self.lengths), self.lengths, shape.padded_len, self.padding,
                           statistics.median(self.total), statistics.median(self.prep), self.total,
                           self.memory, shape.features())


def profile_encoder(
    executor: Any,
    batch_sizes: tuple[int, ...] = QUICK_BATCH_SIZES,
    lengths: tuple[int, ...] = QUICK_LENGTHS,
    repeats: int = 3,
    budget_s: float | None = None,
    padding: str = "dynamic",
    memory: bool = True,
    progress: bool = True,
    seed: int = 0,
    max_batch_tokens: int | None = None,
) -> tuple[CostModel, list[ProfilePoint]]:
    """Profile ``executor`` over ``batch_sizes x lengths`` and fit a ``CostModel``.

    ``budget_s`` bounds the wall time (the server's start-up profile): points run cheapest first, and a
    point whose predicted time (warm-up + repeats + memory run, from the points measured so far) would
    overrun the budget is skipped — except that the first four points always run, the minimum to fit.
    Shapes over ``max_batch_tokens`` (n x L) are left out of the grid.
    """
    model, measured = profile_grid(executor, batch_sizes, lengths, repeats, budget_s, padding, memory,
                                   progress, seed, max_batch_tokens)
    return model, [m.point() for m in measured]


def profile_grid(executor: Any, batch_sizes: tuple[int, ...], lengths: tuple[int, ...], repeats: int = 3,
                 budget_s: float | None = None, padding: str = "dynamic", memory: bool = True,
                 progress: bool = True, seed: int = 0,
                 max_batch_tokens: int | None = None) -> tuple[CostModel, list[Measurement]]:
    if repeats < 1:
        raise ValueError(f"profile: repeats must be >= 1, got {repeats}")
    if padding not in ("dynamic", "none"):
        raise ValueError(f"profile: padding must be 'dynamic' or 'none', got {padding!r}")
    limit = executor.max_length
    shapes = {(b, min(max(L, 3), limit)) for b in batch_sizes for L in lengths}
    shapes = {(b, L) for b, L in shapes if max_batch_tokens is None or b * L <= max_batch_tokens}
    grid = sorted(shapes, key=lambda p: (p[0] * p[1], p))
    k = len(CostModel().feature_names)
    if len(grid) < k:
        raise ValueError(f"profile: the grid has {len(grid)} shapes; give at least {k} "
                         "(more batch sizes or lengths)")
    rng = random.Random(seed)
    lengths_rng = random.Random(seed + 1)  # the grid's lengths, apart from its token ids
    guess = CostModel.default_cpu_minilm()
    calls = repeats + 1 + (2 if memory else 0)  # warm-up, repeats, memory run (profiled: ~2x)
    start = time.perf_counter()
    kept: list[TimedBatch] = []
    with _progress(progress, len(grid) + repeats) as advance:
        for b, L in grid:  # build, warm up and measure memory, cheapest first, within the budget
            if budget_s is not None and len(kept) >= k:
                shape = BatchShape.padded([L] * b, L)
                scale = statistics.median(s.warmup_s / guess.latency(s.batch.shape) for s in kept)
                left = budget_s - (time.perf_counter() - start)
                if calls * guess.latency(shape) * scale > left:
                    advance(f"skip {b}x{L}")
                    continue
            kept.append(TimedBatch(executor, grid_lengths(b, L, limit, lengths_rng), padding, rng, memory))
            advance(f"{b}x{L}: warm-up {kept[-1].warmup_s * 1e3:.1f} ms")
        # then the timed calls round-robin: every shape once per round. This CPU's speed moves by a
        # quarter within minutes; timing shape after shape put a step of it between the small shapes
        # and the large ones and bent the fit (one profile's large batches came out 15 % off their
        # neighbours). Round-robin, a drift moves every shape alike: a speed, which ``profile --recheck``
        # measures.
        for r in range(repeats):
            for s in kept:
                s.time_once()
            advance(f"round {r + 1}/{repeats}")
    out = [s.measurement() for s in kept]
    meta = {"source": "batchpilot profile", "model": executor.model_name, "padding": padding,
            "device": str(executor.device), "points": len(out),
            "prepare_s": statistics.median(m.prepare_s for m in out),  # the live pipeline's lead
            # collation against the run, per shape: whether pipelining can pay (core.deployment)
            "prepare_share": statistics.median(m.prepare_s / m.latency_s for m in out),
            **model_limits(executor)}
    return CostModel.fit([m.point() for m in out], fitted_features(len(out)), meta=meta), out


def grid_lengths(n: int, length: int, limit: int, rng: random.Random) -> list[int]:
    """The input lengths of grid point ``(n, length)``: ``n`` lengths drawn uniformly (seeded by
    ``rng``) from ``length * (1 +- MIX_SPREAD)`` within ``[3, limit]``, sorted, in either padding mode.

    A grid point prices the batches live traffic forms around it, not the best case: a grid of round
    lengths (every input of exactly ``L``, or lengths spread evenly so that a batch holds ``n * L``
    tokens) runs only the shapes the CPU kernels are fastest at, whole tiles of attention and power-of-two
    row counts, and priced live-like batches 7-11% low where random lengths priced them within 2%
    (docs/profiler.md). Live batches almost never repeat a length either, and
    the padding-free forward attends each attention width apart (``models/ragged.py``). A padded point's
    features count its width, ``max(lengths)``."""
    lo, hi = length * (1.0 - MIX_SPREAD), length * (1.0 + MIX_SPREAD)
    return sorted(min(max(int(round(rng.uniform(lo, hi))), 3), limit) for _ in range(n))


def model_limits(executor: Any) -> dict[str, Any]:
    """What the deployment needs to know of the model (``core.deployment.ModelLimits.from_meta``), so the
    simulator resolves the same deployment from the profile as ``serve`` does from the loaded model."""
    from batchpilot.models.device import memory_bytes

    return {"max_length": int(executor.max_length),
            "supports_padding_free": bool(getattr(executor, "supports_padding_free", lambda: True)()),
            "device_memory_bytes": memory_bytes(executor.device)}


def leave_one_out(points: Sequence[ProfilePoint], names: tuple[str, ...] | None = None) -> list[float]:
    """Relative error (predicted / measured - 1) of each point predicted by a model fitted on all the
    others, on ``names`` (default: what a profile of that many shapes is fitted on, ``fitted_features``)."""
    names = names or fitted_features(len(points))
    return [CostModel.fit([*points[:i], *points[i + 1:]], names).latency(p.features) / p.latency_s - 1.0
            for i, p in enumerate(points)]


class _progress:
    """A rich progress bar (or nothing): ``with _progress(on, total) as advance: advance(label)``."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self) -> Any:
        if not self.enabled:
            return lambda label: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), transient=False)
        self.bar.start()
        task = self.bar.add_task("", total=self.total)
        return lambda label: self.bar.update(task, advance=1, description=label)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.stop()


# -- the command line ----------------------------------------------------------------------------
