"""The step model corrected on the live server's own steps (``serve --llm --llm-step-log PATH``).

A step profile times forward + sampling in a quiet process; a live step also schedules, detokenises,
hands every token to the event loop, and shares the core with the HTTP layer writing one SSE event per
stream, and the CPU runs at whatever speed it runs at *now*. While the engine is busy, one step's start
to the next one's is what that step cost every stream in it.

Fitting all six step features freely on those intervals extrapolates badly: live traffic makes
correlated shapes (more decodes, more KV), and a calibration slice of heavy rows (long prompts) fitted
the light steps of the measured slice 20 % low. So the profile keeps the shape and the live steps fit
three numbers on top of it:

    interval = alpha * profile(step) + a + b * decode_seqs

``alpha`` is the CPU's speed now against the profile's, ``a`` the per-step serving cost (scheduling,
waking, the event loop), ``b`` the per-token one (detokenise, deliver, one SSE event). In a replay of
the run's own step log, a fit on one phase predicted the mean interval of the others within 10 % in
most pairs, where the free fit missed by up to 25 %.

``bench fidelity --workload conv-llm`` replays a calibration slice of the trace (rows the measured run
does not use) before each load point and fits on its steps.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.costmodel import CostModel, ProfilePoint, nonneg_lstsq


@dataclass(frozen=True)
class LoggedStep:
    start: float
    wall_s: float
    forward_s: float
    seqs: int
    after_idle: bool
    features: dict[str, float]


def read_json_lines(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The JSON lines a server appended to ``path`` from byte ``offset`` on — whole lines only (it may be
    writing one now) — and the offset to read from next. The step log and the batch log both."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


def read_steps(path: str | Path, offset: int = 0) -> tuple[list[LoggedStep], int]:
    """Steps logged from byte ``offset`` on (whole lines only), and the offset to read from next."""
    rows, end = read_json_lines(path, offset)
    return [LoggedStep(float(d["start"]), float(d["wall_s"]), float(d["forward_s"]), int(d["seqs"]),
                       bool(d["after_idle"]), {k: float(v) for k, v in d["features"].items()})
            for d in rows], end


def busy_intervals(steps: Sequence[LoggedStep]) -> list[ProfilePoint]:
    """Each step's start to the next one's, while the engine stayed busy (the next step did not follow
    an idle wait): one ``ProfilePoint`` per step, on the step's own features."""
    return [ProfilePoint(a.features, b.start - a.start) for a, b in zip(steps, steps[1:], strict=False)
            if not b.after_idle and b.start > a.start]


def fit_live_steps(profile: CostModel, steps: Sequence[LoggedStep], min_points: int = 50) -> CostModel:
    """``profile`` scaled by ``alpha`` with ``a`` added to ``const`` and ``b`` to ``decode_seqs``, fitted
    (least squares: the mean interval is what TPOT is made of) on the live busy intervals."""
    points = busy_intervals(steps)
    if len(points) < min_points:
        raise ValueError(f"only {len(points)} busy step intervals logged (need {min_points}): replay more "
                         "calibration traffic")
    x = np.array([[profile.latency(p.features), 1.0, p.features.get("decode_seqs", 0.0)] for p in points])
    y = np.array([p.latency_s for p in points])
    # non-negative: a serving cost below zero is the fit trading the intercept against alpha (live
    # traffic is mostly one kind of step); one calibration came out at alpha 0.96 and -5 ms and put
    # the next run's steps 20 % low
    alpha, a, b = (float(c) for c in nonneg_lstsq(x, y))
    if alpha <= 0:
        raise ValueError(f"live steps do not follow the profile (alpha = {alpha:.3g}): re-profile")
    extra = {"const": a, "decode_seqs": b}
    coef = tuple(max(alpha * c + extra.get(n, 0.0), 0.0)
                 for n, c in zip(profile.feature_names, profile.latency_coef, strict=True))
    residuals = y / np.maximum(x @ np.array([alpha, a, b]), 1e-9) - 1.0
    return dataclasses.replace(profile, latency_coef=coef,
                               rel_residuals=tuple(sorted(float(r) for r in residuals)),
                               meta={**profile.meta, "live_fit": {"alpha": alpha, "const_s": a,
                                                                  "per_decode_s": b, "points": len(points)}})
