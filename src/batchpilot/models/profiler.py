"""Measure an encoder over a grid of batch shapes and fit the core cost model: ``batchpilot profile``.

For each (batch size n, length L) of the grid, cheapest first: one untimed warm-up call; then
``repeats`` rounds, each timing one ``prepare + run`` call of every shape through the executor itself
(the same path the server takes, same padding mode); a point's latency is the median of its calls.
Round-robin, so that the CPU's speed drifting during the profile scales every shape alike. Peak
memory comes from one more call under ``models.device.peak_memory_bytes`` (docs/profiler.md says what
it counts). Features come from ``BatchShape.padded`` (or ``.ragged`` for padding "none"), and
``CostModel.fit`` turns the points into the model that policies, admission and the simulator share.

Accuracy is reported two ways: leave-one-out over the grid (each point predicted by a model fitted
without it) and, with ``holdout``, seeded mixed-length batches the grid never saw, predicted by the
model fitted on the whole grid.

Then, unless ``--no-serving-path``, the serving path around the batcher: the real app served
in-process, requests sent one at a time (``server/serving_profile.py``), fitted into the simulator's
``sim.frontend.FrontEnd`` and written under the profile's ``"frontend"`` key.

torch is imported lazily: ``batchpilot --help`` must work without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.costmodel import BatchShape, CostModel, ProfilePoint
from ..core.deployment import PRECISIONS as PRECISION_CHOICES
from ..core.deployment import ModelOptions

QUICK_BATCH_SIZES = (1, 4, 16)
QUICK_LENGTHS = (16, 64, 256, 512)
# `batchpilot profile`'s grid: every length doubling and batch sizes up to 16 (29 shapes under the 4096-token
# cap, ~80 s for MiniLM on one CPU core). The quick grid (12 shapes, the server's start-up profile) fitted
# MiniLM with a 14% median / 55% max held-out error; this one with 5% / 8% (docs/profiler.md).
STANDARD_BATCH_SIZES = (1, 2, 4, 8, 16)
STANDARD_LENGTHS = (16, 32, 64, 128, 256, 512)


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
    shape = _Shape(executor, lengths, padding, rng, memory)
    for _ in range(repeats):
        shape.time_once()
    return shape.measurement()


class _Shape:
    """One batch of the grid: built, warmed up (its first call allocates) and its memory measured on
    creation; ``time_once`` adds one timed ``prepare + run`` sample."""

    def __init__(self, executor: Any, lengths: list[int], padding: str, rng: random.Random,
                 memory: bool) -> None:
        from .device import peak_memory_bytes
        from .encoder import make_batch

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
    guess = CostModel.default_cpu_minilm()
    calls = repeats + 1 + (2 if memory else 0)  # warm-up, repeats, memory run (profiled: ~2x)
    start = time.perf_counter()
    kept: list[_Shape] = []
    with _progress(progress, len(grid) + repeats) as advance:
        for b, L in grid:  # build, warm up and measure memory, cheapest first, within the budget
            if budget_s is not None and len(kept) >= k:
                shape = BatchShape.padded([L] * b, L)
                scale = statistics.median(s.warmup_s / guess.latency(s.batch.shape) for s in kept)
                left = budget_s - (time.perf_counter() - start)
                if calls * guess.latency(shape) * scale > left:
                    advance(f"skip {b}x{L}")
                    continue
            kept.append(_Shape(executor, [L] * b, padding, rng, memory))
            advance(f"{b}x{L}: warm-up {kept[-1].warmup_s * 1e3:.1f} ms")
        # then the timed calls round-robin: every shape once per round. This CPU's speed moves by a
        # quarter within minutes; timing shape after shape put a step of it between the small shapes
        # and the large ones and bent the fit (one profile's large batches came out 15 % off their
        # neighbours). Round-robin, a drift moves every shape alike: a speed, which ``bench fidelity``
        # reports as "speed vs profile".
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
    return CostModel.fit([m.point() for m in out], meta=meta), out


def model_limits(executor: Any) -> dict[str, Any]:
    """What the deployment needs to know of the model (``core.deployment.ModelLimits.from_meta``), so the
    simulator resolves the same deployment from the profile as ``serve`` does from the loaded model."""
    from .device import memory_bytes

    return {"max_length": int(executor.max_length),
            "supports_padding_free": bool(getattr(executor, "supports_padding_free", lambda: True)()),
            "device_memory_bytes": memory_bytes(executor.device)}


def leave_one_out(points: list[Measurement]) -> list[float]:
    """Relative error of each point predicted by a model fitted on all the others."""
    errs = []
    for i, m in enumerate(points):
        rest = [p.point() for j, p in enumerate(points) if j != i]
        errs.append(CostModel.fit(rest).latency(m.features) / m.latency_s - 1.0)
    return errs


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
def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure an encoder over batch shapes and fit the cost model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="local HF encoder folder (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile JSON")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(STANDARD_BATCH_SIZES))
    p.add_argument("--lengths", type=int, nargs="+", default=list(STANDARD_LENGTHS), help="tokens per input")
    p.add_argument("--padding", choices=("dynamic", "none"), default="dynamic",
                   help="padded (uniform lengths: dynamic = max = bucket) or padding-free execution")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape (median), after one warm-up")
    p.add_argument("--holdout", type=int, default=4,
                   help="extra seeded mixed-length batches, measured and predicted to report the error")
    p.add_argument("--budget-s", type=float, default=None, help="stop adding shapes past this many seconds")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory run of each shape")
    p.add_argument("--max-batch-tokens", type=int, default=4096,
                   help="leave out shapes with more than n x L tokens (0 = keep all)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", choices=PRECISION_CHOICES, default="auto",
                   help="precision to profile (auto: the fastest this machine supports that passes the "
                        "accuracy guard, measured here; `serve --profile` then serves the same one)")
    p.add_argument("--min-cosine", type=float, default=ModelOptions.min_cosine,
                   help="accuracy guard: least cosine to float32 embeddings on the probe set")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every available core)")
    p.add_argument("--max-length", type=int, default=None, help="serve up to this many tokens (default: "
                   "the model's position limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-serving-path", action="store_true",
                   help="skip the serving-path measurement (the profile's 'frontend' entry)")
    p.add_argument("--serving-requests", type=int, default=24,
                   help="serving path: input lengths from 4 tokens to the model's limit, each sent twice")
    p.add_argument("--loaded-requests", type=int, default=240,
                   help="serving path: open-loop requests that measure a batch's time under serving load "
                        "(0 = not measured)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .device import resolve_device
    from .encoder import EncoderConfig, EncoderExecutor
    from .precision import choose_precision

    console = Console(stderr=True)
    t0 = time.perf_counter()
    def load(dtype: str) -> EncoderExecutor:
        return EncoderExecutor(EncoderConfig(model_path=args.model, device=args.device, dtype=dtype,  # type: ignore[arg-type]
                                             num_threads=args.threads, max_length=args.max_length))

    ex, precision = choose_precision(load, args.dtype, resolve_device(args.device), args.min_cosine)
    ex.warmup()
    console.print(f"{ex.model_name} on {ex.device} ({ex.forward_impl} forward, {ex.num_threads} threads), "
                  f"padding {args.padding}, loaded in {time.perf_counter() - t0:.1f} s; "
                  f"precision: {precision.describe()}")
    t1 = time.perf_counter()
    model, points = profile_grid(ex, tuple(args.batch_sizes), tuple(args.lengths), args.repeats,
                                 args.budget_s, args.padding, not args.no_memory, True, args.seed,
                                 args.max_batch_tokens or None)
    loo = leave_one_out(points) if len(points) > len(model.feature_names) else []
    rng = random.Random(args.seed + 1)
    held: list[tuple[Measurement, float]] = []
    top = min(max(args.lengths), ex.max_length)
    for _ in range(args.holdout):
        lens = [rng.randint(min(8, top), top) for _ in range(rng.randint(1, max(args.batch_sizes)))]
        m = measure(ex, lens, args.padding, args.repeats, rng, memory=False)
        held.append((m, model.latency(m.features) / m.latency_s - 1.0))
    wall = time.perf_counter() - t1

    Console().print(_table(ex.model_name, args.padding, model, points, loo, held))
    coef = ", ".join(f"{n}={c:.3g}" for n, c in zip(model.feature_names, model.latency_coef, strict=True))
    print(f"latency model: {coef}  (seconds per feature unit)")
    summary = _error_summary(loo, [e for _, e in held])
    print("prediction error: " + ", ".join(f"{k} {v:.1%}" for k, v in summary.items()))
    meta = _meta(ex, args, wall, summary)
    model.meta.update({k: meta[k] for k in ("model", "device", "torch", "threads", "date")})
    model.meta.update(dtype=precision.chosen, precision_min_cosine=precision.min_cosine)
    meta["precision"] = {"requested": precision.requested, "chosen": precision.chosen,
                         "min_cosine": precision.min_cosine, "threshold": precision.threshold,
                         "measured": precision.measured, "reason": precision.reason}
    doc = {
        "cost_model": model.to_dict(),
        "points": [m.to_dict() for m in points],
        "holdout": [dict(m.to_dict(), predicted_s=model.latency(m.features)) for m, _ in held],
        "meta": meta,
    }
    if not args.no_serving_path:
        serving = _serving_path(ex, model, args, console)
        if serving is not None:
            doc["frontend"], doc["serving_path"] = serving
    Path(args.output).write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.output} ({len(points)} shapes + {len(held)} held-out batches in {wall:.1f} s)")
    return 0


def _serving_path(ex: Any, model: CostModel, args: argparse.Namespace,
                  console: Any) -> tuple[dict[str, float], dict[str, Any]] | None:
    """The serving-path measurement (``server/serving_profile.py``) as the profile's ``frontend`` and
    ``serving_path`` entries; None, with a warning, when the server stack is missing or it failed (the
    cost model is still written)."""
    try:
        from ..server.serving_profile import measure_serving_path
    except ImportError as exc:
        console.print(f"[yellow]warning:[/] serving path not measured: the server stack is not importable "
                      f"({exc}); the profile has no 'frontend' entry")
        return None
    try:
        frontend, details = measure_serving_path(ex, model, requests=args.serving_requests, seed=args.seed,
                                                 padding=args.padding, loaded_requests=args.loaded_requests)
    except (RuntimeError, ValueError, OSError) as exc:
        console.print(f"[yellow]warning:[/] serving path not measured: {exc}; the profile has no "
                      "'frontend' entry")
        return None
    print(f"serving path ({details['ok']} lone requests, {details['min_tokens']}-{details['max_tokens']} "
          f"tokens, {details['wall_s']:.1f} s): tokenizer {frontend.serial_const_s * 1e3:.2f} ms + "
          f"{frontend.serial_per_token_s * 1e6:.2f} us/token (x{frontend.serial_busy_factor:.2f} with the "
          f"model busy), HTTP/JSON/client {frontend.delay_const_s * 1e3:.2f} ms + "
          f"{frontend.delay_per_token_s * 1e6:.2f} us/token, driver overhead "
          f"{frontend.batch_overhead_s * 1e3:.2f} ms/batch; under load a batch takes "
          f"the cost model x ({frontend.loaded_alpha:.3f} + {frontend.loaded_rate_coef:.4f} x requests/s) + "
          f"{frontend.loaded_const_s * 1e3:.2f} ms, "
          f"spread {details['loaded'].get('residual_std', 0.0):.1%} ({details['loaded'].get('batches', 0)} "
          "batches)")
    return frontend.to_dict(), details


def _table(name: str, padding: str, model: CostModel, points: list[Measurement], loo: list[float],
           held: list[tuple[Measurement, float]]) -> Any:
    from rich.table import Table

    table = Table(title=f"profile of {name} ({padding}), fitted on {len(points)} shapes")
    for col in ("n", "len", "tokens", "median ms", "ms/token", "peak MB", "fit ms", "error"):
        table.add_column(col, justify="right")
    for i, m in enumerate(points):
        toks = m.n * m.padded_len
        table.add_row(str(m.n), str(m.padded_len), str(toks), f"{m.latency_s * 1e3:.1f}",
                      f"{m.latency_s * 1e3 / toks:.3f}", f"{m.memory_bytes / 2**20:.1f}",
                      f"{model.latency(m.features) * 1e3:.1f}", f"{loo[i]:+.0%} LOO" if loo else "-")
    for m, err in held:
        table.add_row(str(m.n), f"mix {min(m.lengths)}-{max(m.lengths)}", str(int(m.features["tokens"])),
                      f"{m.latency_s * 1e3:.1f}", "", "", f"{model.latency(m.features) * 1e3:.1f}",
                      f"{err:+.0%} held-out")
    return table


def _meta(ex: Any, args: argparse.Namespace, wall: float, summary: dict[str, float]) -> dict[str, Any]:
    import platform

    import torch

    cuda = ex.device.type == "cuda"
    return {
        "model": ex.model_name,
        "model_path": ex.model_path,
        "device": str(ex.device),
        "device_name": torch.cuda.get_device_name(ex.device) if cuda else platform.machine(),
        "torch": torch.__version__,
        "threads": ex.num_threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "forward": ex.forward_impl,
        "padding": args.padding,
        "repeats": args.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "memory": "torch.cuda.max_memory_allocated above the pre-call level" if cuda
        else "peak live tensor bytes from torch.profiler CPU allocator events (docs/profiler.md)",
        "wall_s": round(wall, 2),
        "error": summary,
    }


def _error_summary(loo: list[float], held: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    if loo:
        out["leave-one-out median |err|"] = statistics.median(abs(e) for e in loo)
        out["leave-one-out max |err|"] = max(abs(e) for e in loo)
    if held:
        out["held-out median |err|"] = statistics.median(abs(e) for e in held)
        out["held-out max |err|"] = max(abs(e) for e in held)
    return out
