"""The LLM serving path around the step cost model: what the simulator adds to each step and each token.

The step profile (``models.llm.profile``) times forward + sampling of a step shape alone. A live engine
step costs the streams more: scheduling, detokenising and delivering each sequence's token, the event
loop writing every token's SSE chunk on the same cores, the gap to the next step, and the machine's
speed under that load. ``server.llm_serving_profile`` measures it on the real app with the profile's
own traffic (never the traffic it predicts) and writes these fields into the profile's ``frontend``:

* ``first_token_delay_s``: a client's first token arrives this long after the engine made it (HTTP in,
  hand-off, the first chunk out); every token pays it, so TPOT is unchanged.
* ``step_alpha``: the loaded steps' forward seconds over the step profile's prediction for the same
  shapes (the speed, contention inside the forward included).
* ``step_const_s``, ``step_per_seq_s``: what a busy step costs beyond its forward, ``step_const_s +
  step_per_seq_s * seqs``: a step's start-to-next-start interval less its own measured forward,
  averaged over the steps of each sequence count, and the line fitted (non-negative least
  squares) to those means, each count weighing the square root of its steps, so the many steps at
  one to three sequences an open-loop load runs do not outweigh a few at many sequences: the line
  holds over the whole range of sequences per step the load reached (``mean_seqs``, ``max_seqs`` in
  what ``fit_steps`` reports), and is extrapolated beyond it. The forward's own deviation from
  ``step_alpha`` times its prediction stays out of it: a step model that is off by a different
  fraction at one and at 64 sequences would otherwise tilt the line (its slope would price the step
  model's error, paid again on every sequence of every simulated step).

* ``step_seq_factors``: ``(min_seqs, factor)`` per bin of sequences per step (``SEQ_EDGES``: 1, 2-3,
  4-7, 8-15, 16-31, 32+), for steps of decodes only: their forward over ``step_alpha`` times the
  prediction, per bin (``line_fit.binned_factors``: each bin weighs ``SEQ_PRIOR_STEPS`` steps at 1
  beside its own, so a bin of few steps stays near 1). Streaming more sequences' tokens on the same
  cores slows the forward beside it: conv-llm profiles put a loaded decode step's forward at about
  0.9 of its price at one sequence and 1.1 at 16-31 (their ``frontend.step_seq_factors``,
  docs/benchmarks.md "LLM: conv-llm").
* ``prefill_factor``: the same ratio for the steps that carry a prefill chunk, one for every count.
  Such a step is mostly prompt work, which does not follow the decodes' curve; a factor per count
  pooled over both kinds is priced by the profile's mix of them (its loaded phase runs many prefills
  beside few decodes; a loaded server runs mostly decodes) and misprices the other mix.

The prediction these ratios are taken against is ``StepPricer``'s (``sim.llm_step_shape``): the step
model's line times the step profile's own measured shape, so that they hold only what load adds.

A simulated step takes ``step_seconds(predicted, seqs, prefill)``. ``LLMFrontEnd()`` adds nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.core.costmodel import CostModel, nonneg_lstsq
from batchpilot.sim.frontend import check_finite_nonneg
from batchpilot.sim.line_fit import binned_factors, step_factor
from batchpilot.sim.llm_step_shape import StepPricer

SEQ_EDGES = (1, 2, 4, 8, 16, 32)  # the lower bounds of the bins of sequences per step
SEQ_PRIOR_STEPS = 10.0  # a bin's factor weighs this many steps at 1 beside its own


@dataclass(frozen=True)
class LLMFrontEnd:
    """The profile's LLM serving-path fields (module docstring); all finite and >= 0."""

    first_token_delay_s: float = 0.0
    step_alpha: float = 1.0
    step_const_s: float = 0.0
    step_per_seq_s: float = 0.0
    step_seq_factors: tuple[tuple[int, float], ...] = ()
    prefill_factor: float = 1.0

    def __post_init__(self) -> None:
        scalars = {k: v for k, v in asdict(self).items() if k != "step_seq_factors"}
        check_finite_nonneg("llm frontend", scalars)
        factors = tuple((int(lo), float(f)) for lo, f in self.step_seq_factors)
        object.__setattr__(self, "step_seq_factors", factors)
        if factors and (any(not (math.isfinite(f) and f > 0) for _, f in factors)
                        or [lo for lo, _ in factors] != sorted({lo for lo, _ in factors})):
            raise ValueError(f"llm frontend.step_seq_factors = {factors!r}; must be (min_seqs, factor > 0) "
                             "pairs with ascending min_seqs")

    def forward_factor(self, seqs: int, prefill: bool = False) -> float:
        """``step_alpha`` times ``prefill_factor`` for a step with a prefill chunk, else the
        ``step_seq_factors`` entry of a step of ``seqs`` sequences."""
        factor = self.prefill_factor if prefill else step_factor(self.step_seq_factors, seqs)
        return self.step_alpha * factor

    def step_seconds(self, predicted_s: float, seqs: int, prefill: bool = False) -> float:
        """A step's time as the streams see it, from ``StepPricer``'s ``predicted_s``."""
        forward = self.forward_factor(seqs, prefill) * predicted_s
        return forward + self.step_const_s + self.step_per_seq_s * seqs

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = asdict(self)
        d["step_seq_factors"] = [list(p) for p in self.step_seq_factors]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LLMFrontEnd:
        names = {f.name for f in fields(cls)} - {"step_seq_factors"}
        factors = tuple((int(lo), float(f)) for lo, f in d.get("step_seq_factors") or ())
        return cls(**{k: float(v) for k, v in d.items() if k in names}, step_seq_factors=factors)

    @classmethod
    def from_profile(cls, path: str | Path) -> LLMFrontEnd:
        """The profile file's ``frontend`` entry; ``LLMFrontEnd()`` (nothing added) when it has none."""
        return cls.from_dict(json.loads(Path(path).read_text()).get("frontend") or {})

    @classmethod
    def fit_steps(cls, cost_model: CostModel, starts: Sequence[float], forward_s: Sequence[float],
                  wall_s: Sequence[float], seqs: Sequence[int], features: Sequence[dict[str, float]],
                  after_idle: Sequence[bool],
                  first_token_delay_s: float = 0.0) -> tuple[LLMFrontEnd, dict[str, Any]]:
        """Fit the step fields on logged loaded steps, in order (module docstring), each priced by
        ``StepPricer(cost_model)``; a step's cost to the streams is ``step_cycles``. Returns the fields
        and a JSON-ready dict of the fit, with the sequences per step it covered: ``mean_seqs``,
        ``p90_seqs``, ``max_seqs`` and ``seqs_levels`` (distinct counts), and the steps with a prefill
        chunk (``prefill_steps``, and per bin of ``SEQ_EDGES``: ``prefill_steps_by_bin``)."""
        if len(starts) < 10:
            return cls(first_token_delay_s), {"steps": len(starts), "note": "too few steps: not measured"}
        pricer = StepPricer(cost_model)
        pred = np.array([pricer.latency(f) for f in features])
        prefill = np.array([f.get("prefill_tokens", 0.0) > 0 for f in features])
        fwd = np.asarray(forward_s, dtype=float)
        cycle = step_cycles(starts, wall_s, after_idle)
        alpha = float(fwd.sum() / pred.sum()) if pred.sum() > 0 else 1.0
        extra = cycle - fwd  # beyond the step's own forward (module docstring)
        n = np.asarray(seqs, dtype=float)
        const, per_seq = per_level_line(n, extra)
        index = np.searchsorted(np.asarray(SEQ_EDGES[1:]), n, side="right")
        dec = ~prefill
        factors, counts = ((1.0,) * len(SEQ_EDGES), [0] * len(SEQ_EDGES))
        if dec.any():  # binned_factors keeps its line's total: give it the decodes' own
            share = float(fwd[dec].sum() / (alpha * pred[dec]).sum())
            factors, counts = binned_factors(index[dec], len(SEQ_EDGES), fwd[dec], share * alpha * pred[dec],
                                             SEQ_PRIOR_STEPS)
            factors = tuple(f * share for f in factors)
        with_prefill = alpha * pred[prefill]
        prior = SEQ_PRIOR_STEPS * (float(with_prefill.mean()) if with_prefill.size else 1.0)
        pre = (float(fwd[prefill].sum()) + prior) / (float(with_prefill.sum()) + prior)
        fe = cls(first_token_delay_s, alpha, const, per_seq, tuple(zip(SEQ_EDGES, factors, strict=True)), pre)
        factor = np.array([fe.forward_factor(int(k), bool(p)) for k, p in zip(n, prefill, strict=True)])
        line = factor * pred + const + per_seq * n  # step_seconds
        return fe, {
            "steps": len(starts), "mean_seqs": float(n.mean()), "p90_seqs": float(np.percentile(n, 90)),
            "max_seqs": int(n.max()), "seqs_levels": int(np.unique(n).size),
            "forward_over_predicted": alpha, "cycle_over_predicted": float(cycle.sum() / pred.sum()),
            "mean_extra_s": float(extra.mean()), "step_const_s": const, "step_per_seq_s": per_seq,
            "seq_factors": [list(p) for p in fe.step_seq_factors], "seq_factor_steps": counts,
            "prefill_factor": pre, "prefill_steps": int(prefill.sum()),
            "prefill_steps_by_bin": np.bincount(index[prefill], minlength=len(SEQ_EDGES)).tolist(),
            "residual_std": float((cycle / line - 1.0).std())}


def per_level_line(seqs: np.ndarray, extra: np.ndarray) -> tuple[float, float]:
    """``(const, per_seq) >= 0`` of the line ``const + per_seq * seqs`` through the mean ``extra`` of each
    distinct ``seqs``, least squares with each mean weighing the square root of its count (rows
    scaled by its fourth root). Exact on points on such a line."""
    levels, index, counts = np.unique(seqs, return_inverse=True, return_counts=True)
    means = np.bincount(index, weights=extra) / counts
    w = counts ** 0.25
    coef = nonneg_lstsq(np.column_stack([np.ones_like(levels), levels]) * w[:, None], means * w)
    return float(coef[0]), float(coef[1])


def step_cycles(starts: Sequence[float], wall_s: Sequence[float], after_idle: Sequence[bool]) -> np.ndarray:
    """What each logged step cost the streams: the interval to the next step's start when the engine
    went straight on to it (the next step is not ``after_idle``), else the step's own ``wall_s`` (the
    last step, or one before an idle wait)."""
    t, wall = np.asarray(starts, dtype=float), np.asarray(wall_s, dtype=float)
    busy_next = np.r_[~np.asarray(after_idle, dtype=bool)[1:], False]
    return np.where(busy_next, np.r_[np.diff(t), 0.0], wall)
