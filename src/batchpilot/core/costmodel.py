"""Predicted latency and memory of a batch shape: a linear model over a few shape features.

The profiler measures points (shape -> seconds, bytes), ``CostModel.fit`` fits them by least squares
on *relative* error (latencies span two orders of magnitude) with non-negative coefficients, and the
result is JSON. Policies, the planner, admission and the simulator all ask the same object.

Two shape kinds share the machinery:

* ``BatchShape`` (encoders): ``const, n, tokens, attn`` where ``tokens`` are the tokens *computed*
  (``n * padded_len`` padded, ``sum(L)`` padding-free) and ``attn`` the attention work
  (``n * padded_len**2`` padded, ``sum(L**2)`` padding-free). The profiler also fits ``tokens_sq``
  (``tokens**2``, derived from ``tokens``: shapes and batch logs need not carry it): per token, a batch
  of thousands of tokens runs slower than one of hundreds once its activations outgrow the CPU's
  caches (docs/profiler.md). The planner's per-request slopes (``encoder_latency_coef``) leave it out;
  every batch's predicted time and memory (``batch_latency``, ``latency``) include it.
* ``StepShape`` (LLM iterations): ``const, prefill_tokens, decode_seqs, kv_tokens, prefill_attn``.

The high quantile is ``mean * (1 + q)`` where ``q`` is that quantile of the fit's relative residuals,
so a model fitted on noisy points predicts a pessimistic p99, not the mean.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ENCODER_FEATURES: tuple[str, ...] = ("const", "n", "tokens", "attn")
PROFILED_ENCODER_FEATURES: tuple[str, ...] = (*ENCODER_FEATURES, "tokens_sq")  # what the profiler fits
LLM_FEATURES: tuple[str, ...] = ("const", "prefill_tokens", "decode_seqs", "kv_tokens", "prefill_attn",
                                 "multi_row")


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What a padded or padding-free encoder batch costs to run, in countable terms."""

    n: int
    padded_len: int
    tokens: int
    attn: int
    useful_tokens: int

    @classmethod
    def padded(cls, lengths: Sequence[int], padded_len: int) -> BatchShape:
        n = len(lengths)
        return cls(n, padded_len, n * padded_len, n * padded_len * padded_len, int(sum(lengths)))

    @classmethod
    def ragged(cls, lengths: Sequence[int]) -> BatchShape:
        total = int(sum(lengths))
        return cls(len(lengths), max(lengths, default=0), total, int(sum([x * x for x in lengths])), total)

    def features(self) -> dict[str, float]:
        return {"const": 1.0, "n": float(self.n), "tokens": float(self.tokens), "attn": float(self.attn)}


@dataclass(frozen=True, slots=True)
class StepShape:
    """One LLM iteration: packed prefill chunks plus one token for each decoding sequence."""

    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    prefill_attn: int = 0

    def features(self) -> dict[str, float]:
        return {
            "const": 1.0,
            "prefill_tokens": float(self.prefill_tokens),
            "decode_seqs": float(self.decode_seqs),
            "kv_tokens": float(self.kv_tokens),
            "prefill_attn": float(self.prefill_attn),
            # A step of one token row (one decode, nothing else) runs every matmul as matrix x vector;
            # two rows or more take the matrix x matrix path, a fixed step up in cost on CPU that the
            # other features cannot express.
            "multi_row": float(self.prefill_tokens + self.decode_seqs >= 2),
        }


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measurement: the shape's features, its latency (s) and peak memory (bytes)."""

    features: Mapping[str, float]
    latency_s: float
    memory_bytes: float = 0.0


def feature_value(feats: Mapping[str, float], name: str) -> float:
    """A shape's value of the feature ``name``: its own, or derived (``tokens_sq`` from ``tokens``)."""
    value = feats.get(name)
    if value is not None:
        return float(value)
    return float(feats.get("tokens", 0.0)) ** 2 if name == "tokens_sq" else 0.0


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (a tiny active-set loop; a handful of features)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass(slots=True)
class CostModel:
    """Linear latency and memory model over named features. Coefficients are per feature unit."""

    feature_names: tuple[str, ...] = ENCODER_FEATURES
    latency_coef: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    memory_coef: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    rel_residuals: tuple[float, ...] = ()
    quantile: float = 0.99
    meta: dict[str, Any] = field(default_factory=dict)
    _q_factor: float = field(default=1.0, init=False, repr=False)
    # Coefficients of (const, n, tokens, attn) picked out once, for the scheduler's hot path.
    _lat4: tuple[float, float, float, float] = field(default=(0.0, 0.0, 0.0, 0.0), init=False, repr=False)
    _mem4: tuple[float, float, float, float] = field(default=(0.0, 0.0, 0.0, 0.0), init=False, repr=False)
    _sq: tuple[float, float] = field(default=(0.0, 0.0), init=False, repr=False)  # tokens_sq: latency, memory

    def __post_init__(self) -> None:
        k = len(self.feature_names)
        if len(self.latency_coef) != k or len(self.memory_coef) != k:
            raise ValueError(
                f"cost model: {k} features {self.feature_names} but {len(self.latency_coef)} latency and "
                f"{len(self.memory_coef)} memory coefficients; give one coefficient per feature"
            )
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"cost model: quantile must be in (0, 1), got {self.quantile}")
        q = float(np.quantile(self.rel_residuals, self.quantile)) if self.rel_residuals else 0.0
        self._q_factor = 1.0 + max(q, 0.0)
        self._lat4 = self._pick(self.latency_coef)
        self._mem4 = self._pick(self.memory_coef)
        names = self.feature_names
        self._sq = ((self.latency_coef[names.index("tokens_sq")], self.memory_coef[names.index("tokens_sq")])
                    if "tokens_sq" in names else (0.0, 0.0))

    def _pick(self, coef: Sequence[float]) -> tuple[float, float, float, float]:
        by_name = dict(zip(self.feature_names, coef, strict=True))
        return (by_name.get("const", 0.0), by_name.get("n", 0.0), by_name.get("tokens", 0.0),
                by_name.get("attn", 0.0))

    @property
    def q_factor(self) -> float:
        """``latency_q / latency``: 1 + the configured quantile of the relative residuals."""
        return self._q_factor

    @property
    def encoder_latency_coef(self) -> tuple[float, float, float, float]:
        """Latency coefficients of (const, n, tokens, attn); 0 for features this model lacks."""
        return self._lat4

    @property
    def encoder_memory_coef(self) -> tuple[float, float, float, float]:
        """Memory coefficients of (const, n, tokens, attn); 0 for features this model lacks."""
        return self._mem4

    # -- encoder fast path: no shape object, no dict (called per decision) --------------------
    def batch_latency(self, n: float, tokens: float, attn: float) -> float:
        """Mean seconds of an encoder batch given its ``n``, computed ``tokens`` and ``attn`` work."""
        c0, c1, c2, c3 = self._lat4
        return c0 + c1 * n + (c2 + self._sq[0] * tokens) * tokens + c3 * attn

    def batch_memory(self, n: float, tokens: float, attn: float) -> float:
        """Peak bytes of an encoder batch (same features as ``batch_latency``)."""
        c0, c1, c2, c3 = self._mem4
        return c0 + c1 * n + (c2 + self._sq[1] * tokens) * tokens + c3 * attn

    # -- prediction --------------------------------------------------------------------------
    def _dot(self, coef: Sequence[float], shape: BatchShape | StepShape | Mapping[str, float]) -> float:
        feats = shape if isinstance(shape, Mapping) else shape.features()
        return float(sum(c * feature_value(feats, name)
                         for name, c in zip(self.feature_names, coef, strict=True)))

    def latency(self, shape: BatchShape | StepShape | Mapping[str, float]) -> float:
        """Mean predicted seconds for one call on this shape."""
        return self._dot(self.latency_coef, shape)

    def latency_q(self, shape: BatchShape | StepShape | Mapping[str, float]) -> float:
        """Predicted high-quantile seconds (``quantile``, default p99) for this shape."""
        return self.latency(shape) * self._q_factor

    def memory(self, shape: BatchShape | StepShape | Mapping[str, float]) -> float:
        """Predicted peak memory in bytes above the idle baseline for this shape."""
        return self._dot(self.memory_coef, shape)

    def sample_latency(self, shape: BatchShape | StepShape | Mapping[str, float], u: float) -> float:
        """Latency with noise: the mean scaled by a residual picked by ``u`` in [0, 1) (seeded by caller)."""
        mean = self.latency(shape)
        if not self.rel_residuals:
            return mean
        r = self.rel_residuals[min(int(u * len(self.rel_residuals)), len(self.rel_residuals) - 1)]
        return max(mean * (1.0 + r), 0.0)

    # -- fitting -----------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        points: Iterable[ProfilePoint],
        feature_names: tuple[str, ...] = ENCODER_FEATURES,
        quantile: float = 0.99,
        meta: dict[str, Any] | None = None,
    ) -> CostModel:
        pts = list(points)
        if len(pts) < len(feature_names):
            raise ValueError(
                f"cost model fit: need at least {len(feature_names)} profile points, got {len(pts)}"
            )
        x = np.array([[feature_value(p.features, f) for f in feature_names] for p in pts], dtype=float)
        y = np.array([p.latency_s for p in pts], dtype=float)
        if (y <= 0).any():
            raise ValueError("cost model fit: every latency must be > 0 seconds")
        w = 1.0 / y  # relative error: a 10 ms miss matters at 20 ms, not at 2 s
        lat = nonneg_lstsq(x * w[:, None], np.ones_like(y))
        pred = x @ lat
        rel = (y / np.maximum(pred, 1e-12)) - 1.0
        mem_y = np.array([p.memory_bytes for p in pts], dtype=float)
        mem = nonneg_lstsq(x, mem_y) if mem_y.any() else np.zeros(len(feature_names))
        return cls(
            feature_names=tuple(feature_names),
            latency_coef=tuple(float(c) for c in lat),
            memory_coef=tuple(float(c) for c in mem),
            rel_residuals=tuple(sorted(float(r) for r in rel)),
            quantile=quantile,
            meta=dict(meta or {}),
        )

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "feature_names": list(self.feature_names),
            "latency_coef": list(self.latency_coef),
            "memory_coef": list(self.memory_coef),
            "rel_residuals": list(self.rel_residuals),
            "quantile": self.quantile,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        try:
            return cls(
                feature_names=tuple(data["feature_names"]),
                latency_coef=tuple(float(c) for c in data["latency_coef"]),
                memory_coef=tuple(float(c) for c in data["memory_coef"]),
                rel_residuals=tuple(float(r) for r in data.get("rel_residuals", ())),
                quantile=float(data.get("quantile", 0.99)),
                meta=dict(data.get("meta", {})),
            )
        except KeyError as exc:
            raise ValueError(f"cost model JSON is missing the field {exc.args[0]!r}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        # A profile file holds the model under "cost_model" next to its raw points.
        return cls.from_dict(data.get("cost_model", data))

    @classmethod
    def default_cpu_minilm(cls) -> CostModel:
        """A stated conservative default: all-MiniLM-L6-v2 on 2 shared CPU cores (a stated default).

        20 ms fixed per call, ~0.2 ms per computed token, attention 2e-7 s per L^2 unit: batch 1 at
        16/128/512 tokens predicts 24/50/176 ms; 32 x 128 predicts 0.98 s. Memory ~18 KB per token.
        """
        return cls(
            feature_names=ENCODER_FEATURES,
            latency_coef=(0.020, 0.001, 2.0e-4, 2.0e-7),
            memory_coef=(0.0, 0.0, 18_432.0, 48.0),
            rel_residuals=(-0.1, 0.0, 0.1, 0.25),
            meta={"source": "default_cpu_minilm"},
        )


def is_finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0
