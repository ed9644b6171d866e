"""The LLM target: the real ``LLMScheduler`` in the simulator's event loop, each step timed by a cost model.

One slot (one engine), one job per iteration (docs/simulator.md): ``schedule`` asks the scheduler for a
step and returns ``Job(service.step_seconds(price, seqs, prefill), plan)``, ``price`` the step model's
line times the step profile's measured shape (``sim.llm.StepPricer``), ``prefill`` whether
the step carries a prefill chunk (the serving path's step terms, ``sim.llm``; nothing added
without one); when the job ends,
``on_job_done`` feeds ``update`` a dummy token for every sampling chunk (EOS is ignored, as in
conv-llm, so only lengths matter), and records first-token and finish times. The scheduler, block
manager, budgets and preemption are the ones the live engine runs, so TTFT and TPOT predicted here
follow the same policy.

Admission and deadlines are the live engine's (``core/llm/admission.py``): each arrival is one request
of one prompt, admitted by ``LLMAdmission.admit`` (refused when it never fits, 400, or when
``max_num_seqs + max_waiting_seqs`` sequences are already admitted, 503) with the routes' deadline
(``request_deadline``: arrival + ``request_timeout_s``); before each step ``LLMScheduler.expire(now)``
ends the sequences past it (504). A refused or expired request counts in ``rejected`` (its reason: the
server's error code), not as finished, as the load generator counts an error answer or error event.

Preemption by swap: the scheduler gets the same ``PreemptionCosts`` the step is priced with, and a step
that swaps costs ``cost_model.latency(plan.shape)`` plus its block copies
(``PreemptionCosts.swap_s(len(plan.swap_out), len(plan.swap_in))``). The copy figures come from the
profile's ``meta`` (``profile_llm_steps`` on a runner with swap space), else the stated default below.

Prompts are made of distinct token ids per request so the prefix cache (when enabled) never hits by
accident.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from batchpilot.core.costmodel import LLM_FEATURES, CostModel, StepShape, nonneg_lstsq
from batchpilot.core.deployment import DeploymentSpec, LLMDeployment, LLMModelLimits, resolve_llm_deployment
from batchpilot.core.llm.admission import NEVER_FITS, TIMEOUT, LLMAdmission, request_deadline
from batchpilot.core.llm.config import LLMSchedulerConfig, MemoryProfile
from batchpilot.core.llm.fair import TokenPrices
from batchpilot.core.llm.scheduler import (
    SWAP_META_KEYS,
    LLMScheduler,
    PreemptionCosts,
    PreemptionCounters,
    StepPlan,
)
from batchpilot.core.llm.sequence import SamplingParams, StructuredOutput
from batchpilot.core.llm.sequence import Sequence as LLMSequence
from batchpilot.core.request import DEFAULT_TENANT
from batchpilot.core.tenants import TenantTable
from batchpilot.sim.engine import Engine, EngineStats, Job
from batchpilot.sim.service import binned_factors, check_finite_nonneg, step_factor
from batchpilot.sim.traces import Workload

# The step profile's own shape error, read back as a factor on the step model's price.
#
# The LLM step model (``core.costmodel``, linear over ``LLM_FEATURES``) is fitted on the step profile's
# grid (``profile.llm.profile_llm_steps``: prefills alone, decode batches at several contexts,
# a prefill beside a few decodes). Its residuals on that grid are not noise. The runner's matmuls run
# whole tiles of rows, so a step's cost climbs in stairs with its rows, and one straight line over
# decodes and KV tokens cannot follow them: it prices two or three decodes over their time and ten to
# twenty under it, short prompts under and long ones over (``python -m batchpilot.sim.llm
# PROFILE`` prints each grid point's measured time over the line's). Live steps of those shapes run off
# by the same fractions, and the serving path's factors per count of sequences (``sim.llm``)
# would otherwise have to learn the grid's shape from a few hundred loaded steps.
#
# ``StepShapeTable`` keeps ``log(measured / line)`` of every grid point in three tables and interpolates
# them (linearly, in the logarithms of the axes, held at the table's edges beyond them):
#
# * a prefill alone: over its prompt tokens;
# * decodes alone: over the decodes and the KV tokens per decode;
# * a prefill beside decodes: over its prompt tokens and ``1 + decodes``, the prefill-alone table
#   giving the row of no decodes.
#
# ``StepPricer`` is the price every LLM prediction takes: the line times the table's factor. The
# simulator (``sim.llm``) and the serving-path fit (``LLMServiceModel.fit_steps``) both price a step
# through it. A profile without
# ``step_points`` in its ``meta`` (an older one, or the stated default) gets factor 1. A rechecked profile
# (``batchpilot profile --recheck``) keeps the grid's original times beside its rescaled line and
# records the ratio as ``meta.step_points_speed``; the table reads the times at that speed.

def _features(shape: StepShape | Mapping[str, float]) -> tuple[float, float, float]:
    if isinstance(shape, StepShape):
        return float(shape.prefill_tokens), float(shape.decode_seqs), float(shape.kv_tokens)
    return float(shape.get("prefill_tokens", 0.0)), float(shape.get("decode_seqs", 0.0)), \
        float(shape.get("kv_tokens", 0.0))


@dataclass(frozen=True)
class Grid2:
    """``z[i, j]`` at ``(x[i], y[j])``, both axes ascending (already in log); bilinear, held at edges."""

    x: np.ndarray
    y: np.ndarray
    z: np.ndarray

    def __call__(self, x: float, y: float) -> float:
        # only the two rows around x: the same bilinear value as interpolating every row, at two calls
        hi = min(max(int(np.searchsorted(self.x, x)), 1), len(self.x) - 1) if len(self.x) > 1 else 0
        lo = max(hi - 1, 0)
        z_lo, z_hi = (float(np.interp(y, self.y, self.z[k])) for k in (lo, hi))
        if hi == lo or x <= self.x[lo]:
            return z_lo
        if x >= self.x[hi]:
            return z_hi
        w = (x - self.x[lo]) / (self.x[hi] - self.x[lo])
        return z_lo + w * (z_hi - z_lo)


def _table(points: dict[tuple[float, float], float]) -> Grid2 | None:
    """A ``Grid2`` of ``points`` (``(x, y) -> z``); a missing cell takes its row's nearest present one
    (the profile skips decode batches larger than the KV pool)."""
    if not points:
        return None
    xs, ys = sorted({x for x, _ in points}), sorted({y for _, y in points})
    z = np.zeros((len(xs), len(ys)))
    for i, x in enumerate(xs):
        have = [j for j, y in enumerate(ys) if (x, y) in points]
        for j in range(len(ys)):
            near = min(have, key=lambda k: abs(k - j))
            z[i, j] = points[(x, ys[near])]
    return Grid2(np.log(xs), np.log(ys), z)


@dataclass(frozen=True)
class StepShapeTable:
    """The grid's ``log(measured / line)`` in three tables (module docstring); ``factor`` reads them."""

    prefill: tuple[np.ndarray, np.ndarray] | None = None  # (log prompt tokens, log ratio)
    decode: Grid2 | None = None  # (log decodes, log KV tokens per decode)
    mixed: Grid2 | None = None  # (log prompt tokens, log(1 + decodes))

    @classmethod
    def from_cost_model(cls, cost_model: CostModel) -> StepShapeTable:
        """The tables of ``cost_model.meta["step_points"]`` against ``cost_model``'s line (none: empty)."""
        pre: dict[float, float] = {}
        dec: dict[tuple[float, float], float] = {}
        mix: dict[tuple[float, float], float] = {}
        speed = float(cost_model.meta.get("step_points_speed", 1.0))  # a rechecked profile's ratio
        for p in cost_model.meta.get("step_points") or ():
            prompts, b, ctx = [int(n) for n in p["prefills"]], int(p["decodes"]), int(p["context"])
            line = cost_model.latency(step_point_shape(prompts, b, ctx))
            if line <= 0 or float(p["latency_s"]) <= 0 or len(prompts) > 1:
                continue
            r = math.log(float(p["latency_s"]) * speed / line)
            if prompts and b == 0:
                pre[float(prompts[0])] = r
            elif prompts:
                mix[(float(prompts[0]), 1.0 + b)] = r
            elif b > 0:
                dec[(float(b), float(ctx))] = r
        prefill = None
        if pre:
            keys = sorted(pre)
            prefill = (np.log(keys), np.array([pre[k] for k in keys]))
            mix.update({(n, 1.0): pre[n] for n in {x for x, _ in mix} if n in pre})
        return cls(prefill, _table(dec), _table(mix))

    def factor(self, shape: StepShape | Mapping[str, float]) -> float:
        """The grid's measured over the line for a step of this shape (1 where no table covers it)."""
        prompt, decodes, kv = _features(shape)
        if prompt > 0 and decodes == 0 and self.prefill is not None:
            return math.exp(float(np.interp(math.log(prompt), *self.prefill)))
        if prompt > 0 and decodes > 0 and self.mixed is not None:
            return math.exp(self.mixed(math.log(prompt), math.log(1.0 + decodes)))
        if prompt == 0 and decodes > 0 and self.decode is not None:
            return math.exp(self.decode(math.log(decodes), math.log(max(kv / decodes, 1.0))))
        return 1.0


def step_point_shape(prompts: Sequence[int], decodes: int, context: int) -> StepShape:
    """The ``StepShape`` of a profile grid point (``profile.llm.step_plan``: each prompt a fresh
    chunk, each decode at ``context``)."""
    return StepShape(sum(prompts), decodes, sum(prompts) + decodes * context, sum(n * n for n in prompts))


class StepPricer:
    """A step's predicted seconds: ``cost_model``'s line times its ``StepShapeTable`` factor."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.table = StepShapeTable.from_cost_model(cost_model)

    def latency(self, shape: StepShape | Mapping[str, float]) -> float:
        return self.cost_model.latency(shape) * self.table.factor(shape)

    def sample_latency(self, shape: StepShape | Mapping[str, float], u: float) -> float:
        return self.cost_model.sample_latency(shape, u) * self.table.factor(shape)


# The LLM serving path around the step cost model: what the simulator adds to each step and each token.
#
# The step profile (``profile.llm``) times forward + sampling of a step shape alone. A live engine
# step costs the streams more: scheduling, detokenising and delivering each sequence's token, the event
# loop writing every token's SSE chunk on the same cores, the gap to the next step, and the machine's
# speed under that load. ``profile.llm`` measures it on the real app with the profile's
# own traffic (never the traffic it predicts) and writes these fields into the profile's ``service``:
#
# * ``first_token_delay_s``: a client's first token arrives this long after the engine made it (HTTP in,
#   hand-off, the first chunk out); every token pays it, so TPOT is unchanged.
# * ``step_alpha``: the loaded steps' forward seconds over the step profile's prediction for the same
#   shapes (the speed, contention inside the forward included).
# * ``step_const_s``, ``step_per_seq_s``: what a busy step costs beyond its forward, ``step_const_s +
#   step_per_seq_s * seqs``: a step's start-to-next-start interval less its own measured forward,
#   averaged over the steps of each sequence count, and the line fitted (non-negative least
#   squares) to those means, each count weighing the square root of its steps, so the many steps at
#   one to three sequences an open-loop load runs do not outweigh a few at many sequences: the line
#   holds over the whole range of sequences per step the load reached (``mean_seqs``, ``max_seqs`` in
#   what ``fit_steps`` reports), and is extrapolated beyond it. The forward's own deviation from
#   ``step_alpha`` times its prediction stays out of it: a step model that is off by a different
#   fraction at one and at 64 sequences would otherwise tilt the line (its slope would price the step
#   model's error, paid again on every sequence of every simulated step).
#
# * ``step_seq_factors``: ``(min_seqs, factor)`` per bin of sequences per step (``SEQ_EDGES``: 1, 2-3,
#   4-7, 8-15, 16-31, 32+), for steps of decodes only: their forward over ``step_alpha`` times the
#   prediction, per bin (``service.binned_factors``: each bin weighs ``SEQ_PRIOR_STEPS`` steps at 1
#   beside its own, so a bin of few steps stays near 1). Streaming more sequences' tokens on the same
#   cores slows the forward beside it: conv-llm profiles put a loaded decode step's forward at about
#   0.9 of its price at one sequence and 1.1 at 16-31 (their ``service.step_seq_factors``,
#   docs/simulator.md).
# * ``prefill_factor``: the same ratio for the steps that carry a prefill chunk, one for every count.
#   Such a step is mostly prompt work, which does not follow the decodes' curve; a factor per count
#   pooled over both kinds is priced by the profile's mix of them (its loaded phase runs many prefills
#   beside few decodes; a loaded server runs mostly decodes) and misprices the other mix.
#
# The prediction these ratios are taken against is ``StepPricer``'s (``sim.llm``): the step
# model's line times the step profile's own measured shape, so that they hold only what load adds.
#
# A simulated step takes ``step_seconds(predicted, seqs, prefill, structured)``: the last term,
# ``structured_s_per_seq`` for each sampled sequence under a grammar, is measured apart by ``profile``
# (``profile/llm.measure_structured_cost``: decode steps with every sequence under a JSON schema against
# none, interleaved). ``LLMServiceModel()`` adds nothing.

SEQ_EDGES = (1, 2, 4, 8, 16, 32)  # the lower bounds of the bins of sequences per step
SEQ_PRIOR_STEPS = 10.0  # a bin's factor weighs this many steps at 1 beside its own


@dataclass(frozen=True)
class LLMServiceModel:
    """The profile's LLM serving-path fields (module docstring); all finite and >= 0."""

    first_token_delay_s: float = 0.0
    step_alpha: float = 1.0
    step_const_s: float = 0.0
    step_per_seq_s: float = 0.0
    step_seq_factors: tuple[tuple[int, float], ...] = ()
    prefill_factor: float = 1.0
    structured_s_per_seq: float = 0.0  # a sampled sequence under a grammar adds this to its step

    def __post_init__(self) -> None:
        scalars = {k: v for k, v in asdict(self).items() if k != "step_seq_factors"}
        check_finite_nonneg("llm service", scalars)
        factors = tuple((int(lo), float(f)) for lo, f in self.step_seq_factors)
        object.__setattr__(self, "step_seq_factors", factors)
        if factors and (any(not (math.isfinite(f) and f > 0) for _, f in factors)
                        or [lo for lo, _ in factors] != sorted({lo for lo, _ in factors})):
            raise ValueError(f"llm service.step_seq_factors = {factors!r}; must be (min_seqs, factor > 0) "
                             "pairs with ascending min_seqs")

    # per term, the values of its fields that remove it (``without``: the ablation of ``bench fidelity``)
    TERMS: ClassVar[dict[str, dict[str, Any]]] = {
        "first-token delay": {"first_token_delay_s": 0.0},
        "step speed": {"step_alpha": 1.0},
        "step overhead": {"step_const_s": 0.0, "step_per_seq_s": 0.0},
        "sequence factors": {"step_seq_factors": ()},
        "prefill factor": {"prefill_factor": 1.0},
    }

    def without(self, term: str) -> LLMServiceModel:
        """This model with ``term`` (a key of ``TERMS``) removed, the other terms as fitted."""
        return dataclasses.replace(self, **self.TERMS[term])

    def forward_factor(self, seqs: int, prefill: bool = False) -> float:
        """``step_alpha`` times ``prefill_factor`` for a step with a prefill chunk, else the
        ``step_seq_factors`` entry of a step of ``seqs`` sequences."""
        factor = self.prefill_factor if prefill else step_factor(self.step_seq_factors, seqs)
        return self.step_alpha * factor

    def step_seconds(self, predicted_s: float, seqs: int, prefill: bool = False,
                     structured: int = 0) -> float:
        """A step's time as the streams see it, from ``StepPricer``'s ``predicted_s``; ``structured``
        of its sampled sequences are under a grammar (the mask, its application, the matcher's step)."""
        forward = self.forward_factor(seqs, prefill) * predicted_s
        return (forward + self.step_const_s + self.step_per_seq_s * seqs
                + self.structured_s_per_seq * structured)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = asdict(self)
        d["step_seq_factors"] = [list(p) for p in self.step_seq_factors]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LLMServiceModel:
        names = {f.name for f in fields(cls)} - {"step_seq_factors"}
        factors = tuple((int(lo), float(f)) for lo, f in d.get("step_seq_factors") or ())
        return cls(**{k: float(v) for k, v in d.items() if k in names}, step_seq_factors=factors)

    @classmethod
    def from_profile(cls, path: str | Path) -> LLMServiceModel:
        """The profile file's ``service`` entry; ``LLMServiceModel()`` (nothing added) when it has none. A
        profile of an older version (its entry named ``frontend``) is refused, not read as none."""
        doc = json.loads(Path(path).read_text())
        if "frontend" in doc and "service" not in doc:
            raise ValueError(f"{path} holds the serving path of an older batchpilot version ('frontend'); "
                             "run `batchpilot profile --llm` again")
        return cls.from_dict(doc.get("service") or {})

    @classmethod
    def fit_steps(cls, cost_model: CostModel, starts: Sequence[float], forward_s: Sequence[float],
                  wall_s: Sequence[float], seqs: Sequence[int], features: Sequence[dict[str, float]],
                  after_idle: Sequence[bool],
                  first_token_delay_s: float = 0.0) -> tuple[LLMServiceModel, dict[str, Any]]:
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


# The simulated engine's deployment: ``core.deployment.resolve_llm_deployment`` on the profile, as
# serve resolves it on the machine.
#
# ``batchpilot profile --llm`` writes the measured ``memory`` section, the device's free memory
# (``free_bytes``) and the model's position count (``model_max_len``) into the profile;
# ``planned_llm_config`` resolves the deployment from them, so ``simulate --target llm`` runs the engine
# ``serve --llm --llm-profile`` would build on that machine: the same KV pool, length, request timeout
# and admission bound. A profile without a memory section (or none) leaves ``num_kv_blocks`` as given; a
# memory budget then needs one.

def planned_llm_config(spec: DeploymentSpec, profile: str | Path | None) -> LLMDeployment:
    """The deployment of ``spec``'s ``llm:`` section on the profile's machine (its ``plan`` None when the
    profile has no memory section). Raises ``ValueError`` (``KVPlanError``) with what to change."""
    data = json.loads(Path(profile).read_text()) if profile else {}
    memory = MemoryProfile.from_dict(data["memory"]) if "memory" in data else None
    model = LLMModelLimits(int(data["model_max_len"]) if data.get("model_max_len") else None)
    return resolve_llm_deployment(spec, model, memory, data.get("free_bytes"),
                                  swap_on_device=data.get("device", "cpu") == "cpu")


# What an LLM simulation recorded and what it reports: ``LLMRecord`` (per request and per step, filled
# by ``sim.llm.LLMTarget``) and ``summarize_llm`` -> ``LLMSimReport``.
#
# A request is *finished* when it produced its tokens and was neither refused nor expired; one that was
# (``LLMRecord.rejected`` holds the server's error code: ``context_length_exceeded``, ``queue_full``,
# ``timeout``) counts in ``num_rejected`` and ``rejected_by_reason`` only, also when it had streamed some
# tokens before its deadline: the live load generator counts its error event as a failed request.
# TTFT, TPOT, end-to-end latency and output tokens/s are over the finished requests.

@dataclass
class LLMRecord:
    """Per request: arrival, first token, finish (NaN until then), tokens out, why it was refused or
    expired (the server's error code; None: served); per step: shape and time."""

    n: int
    samples: int = 1  # sequences per request: its tokens are all its samples' (TPOT is per sample)
    first_token_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    num_output: list[int] = field(default_factory=list)
    rejected: list[str | None] = field(default_factory=list)
    step_start: list[float] = field(default_factory=list)
    step_duration: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first_token_s = [math.nan] * self.n
        self.finish_s = [math.nan] * self.n
        self.num_output = [0] * self.n
        self.rejected = [None] * self.n


@dataclass
class LLMSimReport:
    num_requests: int
    num_finished: int
    num_rejected: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    num_preemptions: int
    num_steps: int
    mean_step_tokens: float
    mean_step_s: float = math.nan
    mean_step_seqs: float = math.nan
    num_swapped_out: int = 0  # preemptions that swapped (the rest of num_preemptions recomputed)
    num_recomputed_tokens: int = 0  # computed tokens recompute preemptions threw away
    rejected_by_reason: dict[str, int] = field(default_factory=dict)  # refused and expired, by error code

    def rows(self) -> list[tuple[str, str]]:
        ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected_by_reason.items()))
        return [
            ("requests (finished / rejected)",
             f"{self.num_finished} / {self.num_rejected} of {self.num_requests}{f' ({why})' if why else ''}"),
            ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
            ("TTFT p50 / p99", f"{ms(self.ttft_p50)} / {ms(self.ttft_p99)}"),
            ("TPOT p50 / p99", f"{ms(self.tpot_p50)} / {ms(self.tpot_p99)}"),
            ("end-to-end p50 / p99", f"{self.e2e_p50:.2f} s / {self.e2e_p99:.2f} s"),
            ("steps (mean tokens per step)", f"{self.num_steps} ({self.mean_step_tokens:.1f})"),
            ("preemptions (swapped / recomputed)", f"{self.num_preemptions} ({self.num_swapped_out} / "
                                                   f"{self.num_preemptions - self.num_swapped_out})"),
            ("recomputed tokens", str(self.num_recomputed_tokens)),
        ]


def summarize_llm(record: LLMRecord, arrival_s: np.ndarray, num_preemptions: int,
                  preemption: PreemptionCounters, warmup_s: float = 0.0) -> LLMSimReport:
    """The report of a run: requests arriving before ``warmup_s`` are left out of the latencies."""
    rec, arr = record, np.asarray(arrival_s)
    first, fin = np.asarray(rec.first_token_s), np.asarray(rec.finish_s)
    nout = np.asarray(rec.num_output)
    served = np.asarray([r is None for r in rec.rejected], dtype=bool)
    done = ~np.isnan(fin) & (nout > 0) & served & (arr >= warmup_s)
    ttft = (first - arr)[done]
    per_sample = nout / rec.samples
    multi = done & (per_sample > 1)
    tpot = ((fin - first)[multi] / (per_sample[multi] - 1))
    e2e = (fin - arr)[done]

    def q(x: np.ndarray, p: float) -> float:
        return float(np.percentile(x, p)) if x.size else math.nan

    span = float(np.nanmax(fin) - arr[0]) if done.any() else 0.0
    return LLMSimReport(
        num_requests=len(arr), num_finished=int(done.sum()),
        num_rejected=sum(r is not None for r in rec.rejected), duration_s=span,
        rejected_by_reason=dict(Counter(r for r in rec.rejected if r is not None)),
        output_tokens_per_s=float(nout[done].sum() / span) if span > 0 else 0.0,
        ttft_p50=q(ttft, 50), ttft_p99=q(ttft, 99), tpot_p50=q(tpot, 50), tpot_p99=q(tpot, 99),
        e2e_p50=q(e2e, 50), e2e_p99=q(e2e, 99), num_preemptions=num_preemptions,
        num_steps=len(rec.step_start),
        mean_step_tokens=float(np.mean(rec.step_tokens)) if rec.step_tokens else 0.0,
        mean_step_s=float(np.mean(rec.step_duration)) if rec.step_duration else math.nan,
        mean_step_seqs=float(np.mean(rec.step_seqs)) if rec.step_seqs else math.nan,
        num_swapped_out=preemption.num_swapped_out,
        num_recomputed_tokens=preemption.num_recomputed_tokens,
    )


def default_llm_cost_model() -> CostModel:
    """A stated default for the tiny Llama (6 x 512, GQA 8:4) on 2 shared CPU cores, fp32.

    Per step: ~12 ms fixed (Python + 6 layers of small ops), 0.25 ms per prefill token, 0.6 ms per
    decoding sequence, 0.2 us per KV token read, 2 ns per prefill attention unit; copying one KV block of
    16 tokens (6 layers, K and V: 192 KiB) 50 us each way between device and host memory. Replace it with
    ``batchpilot.profile.llm.profile_llm_steps`` for this machine.
    """
    return CostModel(
        feature_names=LLM_FEATURES,
        latency_coef=(0.012, 2.5e-4, 6.0e-4, 2.0e-7, 2.0e-9, 0.0),
        memory_coef=(0.0,) * 6,
        rel_residuals=(-0.1, 0.0, 0.1, 0.3),
        meta={"source": "default_llm_cost_model", "swap_out_s_per_block": 5e-5, "swap_in_s_per_block": 5e-5},
    )


def sim_preemption_costs(cost_model: CostModel, block_size: int | None = None) -> PreemptionCosts:
    """The model's ``PreemptionCosts``; copy figures a profile lacks are ``default_llm_cost_model``'s
    (for 16-token blocks). ``block_size``: the simulated pool's; a copy's time is scaled from the
    block size it was measured at (the profile's ``block_size``) to it, as a copy is linear in bytes."""
    default = default_llm_cost_model().meta
    out, back = (cost_model.meta.get(k, default[k]) for k in SWAP_META_KEYS)
    measured_at = int(cost_model.meta.get("block_size", 16)) if SWAP_META_KEYS[0] in cost_model.meta else 16
    scale = (block_size or measured_at) / measured_at
    return PreemptionCosts.from_cost_model(cost_model, float(out) * scale, float(back) * scale)


class LLMTarget:
    """``SimTarget`` driving an ``LLMScheduler``. Sequence id = workload row index."""

    def __init__(self, scheduler: LLMScheduler, workload: Workload, cost_model: CostModel,
                 noise: bool = False, seed: int = 0, preemption_costs: PreemptionCosts | None = None,
                 service: LLMServiceModel | None = None, requests: LLMRequests | None = None) -> None:
        if not {"const", "decode_seqs"} <= set(cost_model.feature_names) <= set(LLM_FEATURES):
            raise ValueError(f"LLM target: the cost model has features {cost_model.feature_names}, an LLM "
                             f"step model needs {LLM_FEATURES}; profile the LLM (not the encoder)")
        self.scheduler = scheduler
        self.admission = LLMAdmission(scheduler.config, scheduler.fair.weight_of if scheduler.fair else None)
        self.workload = workload
        self.cost_model = cost_model
        self.pricer = StepPricer(cost_model)
        self.preemption_costs = preemption_costs or sim_preemption_costs(cost_model,
                                                                         scheduler.config.block_size)
        self.noise = noise
        self.service = service or LLMServiceModel()
        self._rng = np.random.default_rng(seed)
        self.requests = requests or LLMRequests()
        self.record = LLMRecord(len(workload), self.requests.samples)
        self._inputs = workload.input_tokens.tolist()
        self._outputs = workload.output_tokens.tolist()
        self._prio = workload.priority.tolist()
        self._tenants = None if workload.tenant is None else workload.tenant.tolist()
        self._left = [self.requests.samples] * len(workload)  # samples of each request not finished
        self._busy = False

    @property
    def has_pending(self) -> bool:
        return self.scheduler.has_unfinished()

    def on_arrival(self, index: int, now: float) -> None:
        n_in = max(1, int(self._inputs[index]))
        n_out = max(1, int(self._outputs[index]))
        base = 3 + (index * 7919) % 4000
        k = self.requests.samples
        params = SamplingParams(max_tokens=n_out, ignore_eos=True,
                                structured=STRUCTURED if self.requests.is_structured(index) else None)
        prompt = [base + i for i in range(n_in)]
        deadline = request_deadline(self.scheduler.config, now)
        tenant = self._tenant_of(index)
        seqs = [LLMSequence(index * k + j, prompt, params, arrival=now, priority=int(self._prio[index]),
                            deadline=deadline, group=index * k if k > 1 else None, tenant=tenant)
                for j in range(k)]
        refusal = self.admission.admit(seqs, now)
        if refusal is not None:
            self._end(index, refusal.reason, now)
            return
        for seq in seqs:
            if self.scheduler.add(seq) is not None:  # unreachable: admission ran the same fit test
                self.admission.release(seq.seq_id)
                self._end(index, NEVER_FITS, now)

    def _tenant_of(self, index: int) -> str:
        return self._tenants[index] if self._tenants is not None else DEFAULT_TENANT

    def _end(self, index: int, reason: str, now: float) -> None:
        self.record.rejected[index] = reason
        self.record.finish_s[index] = now

    def schedule(self, now: float, free_slots: int) -> tuple[list[Job], float | None]:
        if free_slots == 0:
            return [], None
        for seq in self.scheduler.expire(now):  # before each step, as the engine thread
            self.admission.release(seq.seq_id)
            self._end(seq.seq_id // self.requests.samples, TIMEOUT, now)
        if not self.scheduler.has_unfinished():
            return [], None
        plan = self.scheduler.schedule(now)  # the same clock as the arrivals: priorities age as live
        if plan.is_empty:
            return [], None
        shape = plan.shape
        predicted = (self.pricer.sample_latency(shape, float(self._rng.random())) if self.noise
                     else self.pricer.latency(shape))
        seqs = self.scheduler.seqs
        structured = sum(1 for c in plan.chunks
                         if c.sample and seqs[c.seq_id].params.structured is not None)
        duration = self.service.step_seconds(predicted, len(plan.chunks), shape.prefill_tokens > 0,
                                             structured)
        duration += self.preemption_costs.swap_s(len(plan.swap_out), len(plan.swap_in))
        rec = self.record
        rec.step_start.append(now)
        rec.step_duration.append(duration)
        rec.step_tokens.append(plan.num_batched_tokens)
        rec.step_seqs.append(len(plan.chunks))
        return [Job(max(duration, 1e-9), plan)], None

    def on_job_done(self, job: Job, now: float) -> None:
        plan: StepPlan = job.payload
        sampled = {c.seq_id: 10 for c in plan.chunks if c.sample}
        rec = self.record
        k = self.requests.samples
        for out in self.scheduler.update(plan, sampled):
            i = out.seq_id // k  # the request's row: its first token, its last sample's end
            if rec.num_output[i] == 0:
                rec.first_token_s[i] = now
            rec.num_output[i] += 1
            if out.finish_reason is not None:
                self.admission.release(out.seq_id)
                self._left[i] -= 1
                if not self._left[i]:
                    rec.finish_s[i] = now


STRUCTURED = StructuredOutput("json_object")  # what a structured request's sequences carry in the simulator


@dataclass(frozen=True)
class LLMRequests:
    """What every simulated request asks beyond its tokens: ``samples`` sequences (``n``; one group that
    shares the prompt's KV blocks, as the engine runs it), and for a ``structured_share`` of the requests
    (chosen by row, the same rows on every run) a grammar, priced by the service model's
    ``structured_s_per_seq``."""

    samples: int = 1
    structured_share: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= 64:
            raise ValueError(f"llm requests: samples must be in [1, 64], got {self.samples}")
        if not 0.0 <= self.structured_share <= 1.0:
            raise ValueError(f"llm requests: structured_share must be in [0, 1], got {self.structured_share}")

    def is_structured(self, index: int) -> bool:
        return (index * 0.6180339887498949) % 1.0 < self.structured_share  # low-discrepancy: any share


@dataclass
class LLMSimRun:
    workload: Workload
    config: LLMSchedulerConfig
    cost_model: CostModel
    stats: EngineStats
    record: LLMRecord
    num_preemptions: int
    preemption: PreemptionCounters = field(default_factory=PreemptionCounters)
    preemption_costs: PreemptionCosts | None = None

    def report(self, warmup_s: float = 0.0) -> LLMSimReport:
        return summarize_llm(self.record, self.workload.arrival_s, self.num_preemptions, self.preemption,
                             warmup_s)


def simulate_llm(workload: Workload, config: LLMSchedulerConfig | None = None,
                 cost_model: CostModel | None = None, *, noise: bool = False, seed: int = 0,
                 service: LLMServiceModel | None = None,
                 preemption_costs: PreemptionCosts | None = None,
                 requests: LLMRequests | None = None, tenants: TenantTable | None = None) -> LLMSimRun:
    """Replay ``workload`` (prompt = input_tokens, output = output_tokens) through a fresh LLMScheduler.
    ``service``: the serving path around the engine (the profile's ``service`` entry,
    ``sim.llm``): each step takes ``service.step_seconds`` of its predicted time, and
    ``first_token_delay_s`` is added to every token's time as the client sees it.
    ``preemption_costs``: what the scheduler weighs swap against recompute with and a step's copies cost
    (default: ``sim_preemption_costs(cost_model)``). ``requests``: samples per request and the share
    under a grammar (``LLMRequests``). ``tenants``: the tenants' weights (policy fair) and quotas, as a
    keys file gives them to the server."""
    config = config or LLMSchedulerConfig()
    cost_model = cost_model or default_llm_cost_model()
    costs = preemption_costs or sim_preemption_costs(cost_model, config.block_size)
    weight_of = (lambda t: tenants.spec(t).weight) if tenants is not None else None
    scheduler = LLMScheduler(config, costs, TokenPrices.from_cost_model(cost_model),  # prices: policy fair
                             weight_of)
    target = LLMTarget(scheduler, workload, cost_model, noise, seed, costs, service, requests)
    if tenants is not None:
        target.admission.set_tenants(tenants, 0.0)
    stats = Engine(target, num_slots=1).run(workload.arrival_s)  # type: ignore[arg-type]
    delay = service.first_token_delay_s if service is not None else 0.0
    if delay:
        rec = target.record
        rec.first_token_s = [t + delay for t in rec.first_token_s]
        rec.finish_s = [t + delay for t in rec.finish_s]
    return LLMSimRun(workload, config, cost_model, stats, target.record, scheduler.num_preemptions,
                     scheduler.preemption, costs)
