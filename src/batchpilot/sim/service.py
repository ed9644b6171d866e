"""The simulator's service model: what a request and a batch cost around the scheduler, and the noise.

The scheduler prices a batch with the cost model. A served request also pays the path around the
Batcher, and a served batch's time moves with the load and scatters around its price. ``ServiceModel``
holds what of that pays in prediction for the encoder target, fitted by ``batchpilot profile`` alone
(``profile/serving.py``), never on the traffic it predicts:

    fits            ``fit_line`` (a robust ``y ~ a + b x``, ``a, b >= 0``), ``binned_factors`` and
                    ``step_factor`` (a factor per step of a step function)
    RequestCost     what a request spends outside the batcher: ``const + per_token * L``
    BatchCost       a batch's time under serving load: its price times ``alpha`` and its size step's
                    factor, plus a constant and the live driver's overhead
    Noise           a served batch's spread around that line, drawn seeded by ``BatchNoise``
    ServiceModel    the three parts, the profile's ``"service"`` entry; ``TERMS`` and ``without`` for
                    the ablation (``bench fidelity --rescore --ablate``)

Each term is here because removing it made the prediction worse on the encoder fidelity matrix
(docs/simulator.md, "The service-time model": the ablation table). The LLM target's counterpart is
``sim.llm.LLMServiceModel``.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

# -- Fits ------------------------------------------------------------------------------------------

def fit_line(x: np.ndarray, y: np.ndarray, trim: bool = True) -> tuple[float, float]:
    """``y ~ a + b x`` by least squares without the worst 10% of residuals (``trim``), with a, b >= 0 (a
    negative slope or intercept is noise: fall back to the one-parameter fit — the median, or untrimmed
    the mean, so that the fitted line keeps the mean of ``y``)."""
    a, b = _lstsq(x, y)
    keep = np.abs(y - a - b * x) <= np.percentile(np.abs(y - a - b * x), 90)  # drop the scheduler hiccups
    if trim and keep.sum() >= 3:
        a, b = _lstsq(x[keep], y[keep])
    if b < 0 or np.ptp(x) == 0:
        return max(float(np.median(y) if trim else np.mean(y)), 0.0), 0.0
    if a < 0:
        return 0.0, max(float(np.dot(x, y) / np.dot(x, x)), 0.0)
    return a, b


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if np.ptp(x) == 0:
        return float(np.mean(y)), 0.0
    coef = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)[0]
    return float(coef[0]), float(coef[1])


def binned_factors(index: np.ndarray, bins: int, took: np.ndarray, line: np.ndarray,
                   prior: float) -> tuple[tuple[float, ...], list[int]]:
    """Per bin ``k`` (the rows with ``index == k``): ``(sum took + prior * m) / (sum line + prior * m)``,
    ``m`` the bin's mean line, so a bin of few rows stays near 1 (none: exactly 1). Normalised so that
    the line times the factors keeps the line's total (``sum line``; pass a line scaled to ``sum took``
    for factors that keep the measured total). Returns the factors and the rows per
    bin."""
    factors, counts = [], []
    for k in range(bins):
        cell = index == k
        n = int(cell.sum())
        counts.append(n)
        m = float(line[cell].mean()) if n else 1.0
        factors.append((float(took[cell].sum()) + prior * m) / (float(line[cell].sum()) + prior * m))
    scale = float(line.sum()) / float(sum(line[index == k].sum() * f for k, f in enumerate(factors)))
    return tuple(f * scale for f in factors), counts


def step_factor(steps: Sequence[tuple[int, float]], x: float) -> float:
    """The factor of the last ``(lower_bound, factor)`` of ``steps`` (ascending bounds) not above ``x``;
    1 without steps."""
    return steps[max(bisect.bisect_right([lo for lo, _ in steps], x) - 1, 0)][1] if steps else 1.0



def check_finite_nonneg(what: str, values: dict[str, float]) -> None:
    """Raise ``ValueError`` naming the first of ``values`` that is not a finite number >= 0."""
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{what}.{name} = {value!r}; must be a finite number >= 0")


# -- RequestCost: what a request costs around the batcher -------------------------------------------
# A live request does more than wait in the Batcher: the server parses it, tokenises it, JSON-encodes
# the answer and the client reads it back. The core never sees that time, so a simulator of the core
# alone predicts the *batcher's* latency, not the client's. ``RequestCost`` adds it to every request's
# finish time as ``delay_const_s + delay_per_token_s * L``, fitted by ``fit`` on the profile's lone
# requests (one at a time, no queueing anywhere): the client's latency less the server's ``batcher``
# part (``Server-Timing``). It overlaps across requests: at the loads a prediction is used at, the
# tokenizer's queue and the event loop's extra work under load moved the matrix by less than its
# ablation's threshold, and are not modelled.

@dataclass(frozen=True)
class RequestCost:
    delay_const_s: float = 0.0
    delay_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        check_finite_nonneg("service.request", asdict(self))

    def delay(self, tokens: np.ndarray) -> np.ndarray:
        """Each request's time outside the batcher, by its input tokens."""
        return self.delay_const_s + self.delay_per_token_s * np.asarray(tokens, dtype=float)

    def mean_s(self, tokens: np.ndarray) -> float:
        """Mean time outside the batcher, for reports."""
        t = np.asarray(tokens, dtype=float)
        return float(np.mean(self.delay(t))) if t.size else 0.0

    @classmethod
    def fit(cls, tokens: np.ndarray, client_s: np.ndarray, batcher_s: np.ndarray) -> RequestCost:
        """Fit the line on requests measured one at a time: per request its token count, the client's
        latency and the server's ``batcher`` part. Rows with a NaN are skipped; fewer than 3 usable rows
        is an error (no Server-Timing header: not a batchpilot server)."""
        tokens, client_s, batcher_s = (np.asarray(x, dtype=float) for x in (tokens, client_s, batcher_s))
        ok = np.isfinite(tokens) & np.isfinite(client_s) & np.isfinite(batcher_s)
        if ok.sum() < 3:
            raise ValueError(f"request-cost fit needs >= 3 requests with Server-Timing, got {int(ok.sum())}")
        dc, dp = fit_line(tokens[ok], client_s[ok] - batcher_s[ok])
        return cls(delay_const_s=dc, delay_per_token_s=dp)


# -- BatchCost: what a batch costs around its price ---------------------------------------------------
# Under serving load a batch takes ``price * alpha * token_factor + const_s + overhead_s``: the price the
# cost model's (the profiler's batches, alone in its loop), ``alpha`` how much slower the model runs while
# the server handles traffic on the same cores, ``token_factors`` ``(min_tokens, factor)`` steps of the
# batch's computed tokens (the thread plan's steps and every doubling from 32 tokens,
# ``profile.serving.loaded_token_steps``: a batch on two threads contends with the front end for the
# second core, a short batch feels the hand-offs more than a long one), ``const_s`` a constant per
# batch, all fitted on the profile's own open-loop traffic (``profile.serving.fit_loaded``);
# ``overhead_s`` what the live driver adds around the model (the scheduling call, collation, the
# event-loop and thread hand-offs: lone requests' ``batcher`` time less their slot time). No factors: 1.

@dataclass(frozen=True)
class BatchCost:
    alpha: float = 1.0
    const_s: float = 0.0
    token_factors: tuple[tuple[int, float], ...] = ()
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        steps = tuple((int(lo), float(f)) for lo, f in self.token_factors)
        object.__setattr__(self, "token_factors", steps)
        if steps and (steps[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(steps, steps[1:], strict=False))
                      or not all(math.isfinite(f) and f > 0 for _, f in steps)):
            raise ValueError("service.batch.token_factors must be (min_tokens, factor) steps ascending from "
                             f"0 tokens with positive factors, got {steps!r}")
        check_finite_nonneg("service.batch",
                            {"alpha": self.alpha, "const_s": self.const_s, "overhead_s": self.overhead_s})

    def seconds(self, price_s: float, tokens: float = 0.0) -> float:
        """A batch's model time under serving load (its line), from its price and computed tokens; the
        one formula, for the simulator and for the profile's fit."""
        return price_s * self.alpha * step_factor(self.token_factors, tokens) + self.const_s


# -- Noise: a batch's spread around its line -----------------------------------------------------------
# The profile's loaded phase prices every batch it served by its line (``BatchCost.seconds``) and keeps
# ``slot / line - 1``: the stalls a batch meets on shared cores, the host's pauses. ``BatchNoise`` draws
# one of them per simulated batch, seeded, so that one simulated run is one sample of what the server may
# do and the draws' band says how far one live run of the same rows may fall from another
# (``sim.draws``).

POOL = 4096  # uniforms drawn at once for the per-batch residuals


@dataclass(frozen=True)
class Noise:
    """Sorted relative residuals of the profile's loaded batches around their line. None: batch times
    are not drawn, every batch takes its line."""

    residuals: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "residuals", tuple(sorted(float(r) for r in self.residuals)))
        if any(not math.isfinite(r) or r <= -1.0 for r in self.residuals):
            raise ValueError("service.noise.residuals must be finite relative errors > -1")

    def sampler(self, seed: int) -> BatchNoise | None:
        """A seeded ``BatchNoise`` of these residuals; None when there is nothing to draw."""
        return BatchNoise(self.residuals, seed) if self.residuals else None


class BatchNoise:
    """Draws a served batch's time around its line ``mean`` (``draw``), seeded: one relative residual
    picked per batch."""

    def __init__(self, residuals: Sequence[float], seed: int = 0) -> None:
        self._residuals = tuple(residuals)
        self._rng = np.random.default_rng(seed)
        self._u: list[float] = []

    def draw(self, mean: float) -> float:
        """``mean`` times one plus a drawn residual; never below 0."""
        if not self._residuals:
            return mean
        if not self._u:
            self._u = self._rng.random(POOL).tolist()
        res = self._residuals
        return max(mean * (1.0 + res[min(int(self._u.pop() * len(res)), len(res) - 1)]), 0.0)


# -- ServiceModel: the three, for one encoder target ---------------------------------------------------

@dataclass(frozen=True)
class ServiceModel:
    """What a request costs around the batcher (``request``), what a batch costs around its price
    (``batch``) and how a batch's time scatters (``noise``): everything the encoder simulator adds to
    the scheduler and the cost model, fitted by ``batchpilot profile`` alone and written under the
    profile's ``"service"`` key. ``TERMS`` names its terms; ``without(term)`` is the model with one
    removed (the ablation of ``bench fidelity --rescore --ablate``)."""

    request: RequestCost = field(default_factory=RequestCost)
    batch: BatchCost = field(default_factory=BatchCost)
    noise: Noise = field(default_factory=Noise)

    # per term: its part and the values of its fields that remove it
    TERMS: ClassVar[dict[str, tuple[str, dict[str, Any]]]] = {
        "request delay": ("request", {"delay_const_s": 0.0, "delay_per_token_s": 0.0}),
        "loaded line": ("batch", {"alpha": 1.0, "const_s": 0.0}),
        "token factors": ("batch", {"token_factors": ()}),
        "batch overhead": ("batch", {"overhead_s": 0.0}),
        "residuals": ("noise", {"residuals": ()}),
    }

    def without(self, term: str) -> ServiceModel:
        """This model with ``term`` (a key of ``TERMS``) removed, the other terms as fitted."""
        part, values = self.TERMS[term]
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **values)})

    @property
    def draws_batch_times(self) -> bool:
        """Whether runs of different seeds differ (``sim.draws``): the noise has something to draw."""
        return bool(self.noise.residuals)

    def to_dict(self) -> dict[str, Any]:
        d = {"request": asdict(self.request), "batch": asdict(self.batch), "noise": asdict(self.noise)}
        d["batch"]["token_factors"] = [list(step) for step in self.batch.token_factors]
        d["noise"]["residuals"] = list(self.noise.residuals)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServiceModel:
        """The inverse of ``to_dict``; fields a part lacks keep their defaults, unknown ones (a profile
        of another batchpilot version) are refused."""
        kinds = {"request": RequestCost, "batch": BatchCost, "noise": Noise}
        unknown = sorted(set(d) - set(kinds))
        for name, kind in kinds.items():
            known = {f.name for f in fields(kind)}
            unknown += [f"{name}.{k}" for k in sorted(set(d.get(name) or {}) - known)]
        if unknown:
            raise ValueError(f"the profile's service model has unknown fields {', '.join(unknown)}: it was "
                             "written by another batchpilot version; run `batchpilot profile` again")
        parts: dict[str, Any] = {}
        for name, kind in kinds.items():
            entry = dict(d.get(name) or {})
            if "token_factors" in entry:
                entry["token_factors"] = tuple((int(lo), float(f)) for lo, f in entry["token_factors"])
            if "residuals" in entry:
                entry["residuals"] = tuple(float(x) for x in entry["residuals"])
            parts[name] = kind(**entry)
        return cls(**parts)

    @classmethod
    def from_profile(cls, path: str | Path) -> ServiceModel | None:
        """The ``"service"`` entry of a ``batchpilot profile`` JSON, or None when it has none (a profile
        written with ``--no-serving-path``). A profile with the older flat ``"frontend"`` entry is
        refused."""
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict):
            return None
        if "service" not in doc and "frontend" in doc:
            raise ValueError(f"{path} holds a service model of an older batchpilot version ('frontend'); run "
                             "`batchpilot profile` again")
        entry = doc.get("service")
        return None if entry is None else cls.from_dict(entry)
