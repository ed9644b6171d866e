"""The encoder cost model corrected on the live server's own batches (``serve --batch-log PATH``).

A profile times the model in a quiet process at one moment; the server runs the same batches from an
executor thread (a hand-off per batch) on a CPU whose speed on this machine moves by a quarter within
minutes with nothing else changing (``benchmarks/encoder_drift.py``). The profile keeps the shape
(what a batch of n inputs of these lengths costs relative to another); the live batches fit two
numbers on top of it:

    slot_s = alpha * profile(batch) + a

``alpha`` the CPU's speed now against the profile's, ``a`` the per-batch serving cost (the hand-off to
the executor thread and back). Non-negative least squares on relative errors: fitted on absolute ones,
the few long batches decided the fit and the many short ones came out ~6 % over. That split matters
beyond the mean: the server's backlog bound scales its predictions by a moving average of each
batch's measured/predicted ratio, most of them short batches, so which inputs a burst refuses — and
the P99 of the admitted ones at 80 % of capacity — followed it. On relative errors the calibration's
fit also came out closer to the same fit on the run that followed it (docs/loadgen.md, session 4).
``bench fidelity`` replays calibration traffic right before each load point and fits on
the batches it made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.costmodel import CostModel, nonneg_lstsq
from ..sim.frontend import FrontEnd, fit_line
from ..sim.traces import Workload
from .capacity import rate_matched, wait_idle
from .llm_steps import read_json_lines
from .loadgen import LoadGenConfig, build_plan, replay
from .records import RequestRecord


@dataclass(frozen=True)
class LoggedBatch:
    start: float
    slot_s: float
    n: int
    features: dict[str, float]
    formed: float = math.nan  # when the scheduler formed it (NaN in logs written before the field)


def read_batches(path: str | Path, offset: int = 0) -> tuple[list[LoggedBatch], int]:
    """Batches logged from byte ``offset`` on (whole lines only), and the offset to read from next."""
    rows, end = read_json_lines(path, offset)
    return [LoggedBatch(float(d["start"]), float(d["slot_s"]), int(d["n"]),
                        {k: float(v) for k, v in d["features"].items()}, float(d.get("formed", math.nan)))
            for d in rows], end


def fit_live_batches(profile: CostModel, batches: Sequence[LoggedBatch], min_batches: int = 30) -> CostModel:
    """``profile`` scaled by ``alpha`` with ``a`` added to ``const``, fitted on the live batches' slot
    times. The profile's residual spread is kept (relative noise: it scales with the speed)."""
    if len(batches) < min_batches:
        raise ValueError(f"only {len(batches)} batches logged (need {min_batches}): replay more "
                         "calibration traffic")
    x = np.array([[profile.latency(b.features), 1.0] for b in batches])
    y = np.array([b.slot_s for b in batches])
    w = 1.0 / np.maximum(y, 1e-6)  # relative errors: every batch counts alike, as in CostModel.fit
    alpha, a = (float(c) for c in nonneg_lstsq(x * w[:, None], y * w))
    if alpha <= 0:
        raise ValueError(f"live batches do not follow the profile (alpha = {alpha:.3g}): re-profile")
    coef = tuple(alpha * c + (a if name == "const" else 0.0)
                 for name, c in zip(profile.feature_names, profile.latency_coef, strict=True))
    pred = x @ np.array([alpha, a])
    return dataclasses.replace(profile, latency_coef=coef, meta={
        **profile.meta, "live_fit": {"alpha": alpha, "const_s": a, "batches": len(batches),
                                     "median_rel_error": float(np.median(np.abs(y / pred - 1.0)))}})


def calibration_rows(workload: Workload, texts: Sequence[str], measured: int, rate_scale: float,
                     seconds: float, seed: int = 0) -> tuple[Workload, list[str]]:
    """Calibration traffic for a measured run of the slice's first ``measured`` rows at ``rate_scale``:
    the arrival times of the rows after them (``seconds`` of them, at the measured rows' mean rate:
    ``capacity.rate_matched``), each with the
    length and text of a measured row drawn at random (seeded). Other times, the measured run's mix of
    lengths: the batch shapes depend on it."""
    rest = workload.slice(measured, len(workload) - measured) if len(workload) - measured >= 30 else workload
    times = rate_matched(rest, workload.slice(0, measured), rate_scale, seconds)
    pick = np.random.default_rng(seed + measured).integers(0, measured, len(times))
    rows = Workload.from_columns("calibration", times.arrival_s, workload.input_tokens[pick])
    return rows, [texts[int(i)] for i in pick]


def speed_moved(model: CostModel, batches: Sequence[LoggedBatch]) -> float:
    """How far the batches' total slot time is from ``model``'s prediction for the same batches (+0.1:
    they took 10 % longer). Run on a measured run's own batches with the model calibrated before it:
    how far the CPU's speed moved in between."""
    predicted = sum(model.latency(b.features) for b in batches)
    return sum(b.slot_s for b in batches) / predicted - 1.0 if predicted > 0 else math.nan


def measure_again(load: float, moved: float, tolerance: float, attempt: int, tries: int, what: str) -> bool:
    """Whether a load point's run is repeated: its own batches (``what``: "batches", "busy steps") took
    more than ``tolerance`` off the model calibrated just before it, and attempts are left. Says why."""
    if not math.isfinite(moved) or abs(moved) <= tolerance or attempt >= tries:
        return False
    print(f"{load:.0%}: the run's {what} took {moved:+.1%} against the model calibrated just before it "
          f"(tolerance {tolerance:.0%}): the CPU's speed moved, so this run does not hold the simulator to "
          f"the machine it was calibrated on; calibrating and measuring again (attempt {attempt + 1} of "
          f"{tries})", flush=True)
    return True


@dataclass
class SpeedCalibration:
    model: CostModel  # the profile at the live speed (``fit_live_batches``)
    batches: list[LoggedBatch]
    records: list[RequestRecord]  # the calibration requests, with their Server-Timing split


def calibrate_speed(url: str, profile: CostModel, batch_log: Path, rows: Workload,
                    texts: Sequence[str]) -> SpeedCalibration:
    """Replay ``rows`` (open loop) against the server writing ``batch_log`` and fit the profile's speed
    on the batches they made (``fit_live_batches``)."""
    offset = batch_log.stat().st_size if batch_log.exists() else 0
    res = replay(build_plan(rows, texts=list(texts)), LoadGenConfig(url, progress=False, scrape_interval_s=0))
    wait_idle(url, 10.0)
    batches = read_batches(batch_log, offset)[0]
    return SpeedCalibration(fit_live_batches(profile, batches), batches, res.records)


def delay_under_load(frontend: FrontEnd, records: Sequence[RequestRecord]) -> FrontEnd:
    """``frontend`` with its delay part (HTTP, JSON, the client: what overlaps across requests) refitted
    on requests served under load: with the model's thread on the same core and other requests'
    parsing on the event loop, a request spends 1-2 ms more there than alone (4.2 -> 6.1 ms at 80 %
    of capacity). Untrimmed least squares: under load that delay has a tail (P99 2x the median), and
    the simulator adds its mean to every request. The serial part (the tokenizer thread) stays the
    idle fit: under load its ``Server-Timing`` includes the wait for that thread, which the simulator's
    queue models."""
    ok = [r for r in records
          if r.ok and math.isfinite(r.server_tokenize_s) and math.isfinite(r.server_batcher_s)]
    if len(ok) < 10:
        return frontend
    tokens = np.array([r.input_tokens for r in ok], dtype=float)
    delay = np.array([r.latency_s - r.server_tokenize_s - r.server_batcher_s for r in ok])
    const, per_token = fit_line(tokens, delay, trim=False)
    return dataclasses.replace(frontend, delay_const_s=const, delay_per_token_s=per_token)
