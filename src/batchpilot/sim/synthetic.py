"""Synthetic workloads: arrival processes, length distributions and priority mixes, all seeded.

Arrivals (``n`` times starting at 0):
* ``poisson``  - exponential gaps at ``rate`` (CV 1).
* ``renewal``  - gamma gaps with mean ``1/rate`` and a chosen coefficient of variation ``cv``
  (shape ``1/cv^2``): ``cv < 1`` is smoother than Poisson, ``cv > 1`` burstier (the Azure trace is ~1.1).
* ``mmpp``     - on/off Markov-modulated Poisson: ``rate_on`` for exponential ``on_s`` periods,
  ``rate_off`` for ``off_s`` periods (bursts like the trace's second 40-50).
* ``diurnal``  - non-homogeneous Poisson with ``rate * (1 + amplitude * sin(2 pi t / period_s))``,
  drawn by thinning.
Lengths: ``lognormal`` (median, sigma), ``bimodal`` (two lognormal modes), ``empirical`` (resample a
trace's lengths), all clipped to ``[lo, hi]``. Priorities: a mix ``{priority: weight}``.

``parse_spec("renewal:rate=20,cv=3")`` turns the CLI's compact form into keyword arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from batchpilot.sim.traces import Workload, conv_embed, load_workload

ARRIVALS = ("poisson", "renewal", "mmpp", "diurnal")
LENGTHS = ("lognormal", "bimodal", "empirical", "constant")


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"synthetic: rate must be > 0 requests/s, got {rate}")


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    t = np.cumsum(gaps)
    return t - t[0] if t.size else t


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    _check_rate(rate)
    return _from_gaps(rng.exponential(1.0 / rate, n))


def renewal_arrivals(rate: float, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    _check_rate(rate)
    if not cv > 0:
        raise ValueError(f"synthetic: cv must be > 0 (1 is Poisson), got {cv}")
    shape = 1.0 / (cv * cv)
    return _from_gaps(rng.gamma(shape, 1.0 / (rate * shape), n))


def mmpp_arrivals(
    rate_on: float, rate_off: float, on_s: float, off_s: float, n: int, rng: np.random.Generator
) -> np.ndarray:
    _check_rate(rate_on)
    if rate_off < 0 or on_s <= 0 or off_s <= 0:
        raise ValueError("synthetic mmpp: rate_off must be >= 0, on_s and off_s > 0")
    out: list[np.ndarray] = []
    t, on, total = 0.0, True, 0
    while total < n:
        period = rng.exponential(on_s if on else off_s)
        rate = rate_on if on else rate_off
        k = rng.poisson(rate * period) if rate > 0 else 0
        if k:
            out.append(np.sort(t + rng.random(k) * period))
            total += k
        t += period
        on = not on
    times = np.concatenate(out)[:n]
    return times - times[0]


def diurnal_arrivals(
    rate: float, amplitude: float, period_s: float, n: int, rng: np.random.Generator
) -> np.ndarray:
    _check_rate(rate)
    if not 0 <= amplitude <= 1 or period_s <= 0:
        raise ValueError("synthetic diurnal: amplitude must be in [0, 1] and period_s > 0")
    peak = rate * (1 + amplitude)
    out: list[np.ndarray] = []
    t, total = 0.0, 0
    while total < n:
        cand = t + np.cumsum(rng.exponential(1.0 / peak, max(1024, n)))
        keep = rng.random(cand.size) * peak <= rate * (1 + amplitude * np.sin(2 * math.pi * cand / period_s))
        out.append(cand[keep])
        total += int(keep.sum())
        t = float(cand[-1])
    times = np.concatenate(out)[:n]
    return times - times[0]


def lognormal_lengths(
    median: float, sigma: float, n: int, rng: np.random.Generator, lo: int = 1, hi: int = 512
) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(np.int64)


def bimodal_lengths(
    short: float, long: float, p_long: float, n: int, rng: np.random.Generator,
    sigma: float = 0.25, lo: int = 1, hi: int = 512,
) -> np.ndarray:
    if not 0 <= p_long <= 1:
        raise ValueError(f"synthetic bimodal: p_long must be in [0, 1], got {p_long}")
    medians = np.where(rng.random(n) < p_long, long, short)
    return np.clip(np.round(medians * rng.lognormal(0.0, sigma, n)), lo, hi).astype(np.int64)


def empirical_lengths(values: Sequence[int] | np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    pool = np.asarray(values, dtype=np.int64)
    if pool.size == 0:
        raise ValueError("synthetic empirical: no lengths to resample")
    return pool[rng.integers(0, pool.size, n)]


def priority_mix(weights: Mapping[int, float], n: int, rng: np.random.Generator) -> np.ndarray:
    """``{0: 0.9, -1: 0.1}``: 10% urgent (lower value is served first)."""
    keys = np.array(list(weights), dtype=np.int64)
    p = np.array([weights[k] for k in weights], dtype=float)
    if keys.size == 0 or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"synthetic: priority weights must be >= 0 with a positive sum, got {weights}")
    return keys[rng.choice(keys.size, n, p=p / p.sum())]


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``"renewal:rate=20,cv=3"`` -> ``("renewal", {"rate": 20.0, "cv": 3.0})``."""
    kind, _, rest = spec.partition(":")
    kwargs: dict[str, float] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"synthetic spec {spec!r}: expected key=value, got {part!r}")
        kwargs[key.strip()] = float(value)
    return kind.strip(), kwargs


def synthetic_workload(
    arrivals: str,
    n: int,
    lengths: str = "lognormal:median=128,sigma=0.8",
    seed: int = 0,
    priorities: Mapping[int, float] | None = None,
    empirical_pool: Sequence[int] | np.ndarray | None = None,
    output_tokens: int = 0,
) -> Workload:
    """Build a workload from compact specs, e.g. ``synthetic_workload("mmpp:rate_on=40,rate_off=4,
    on_s=10,off_s=30", 10000, "bimodal:short=32,long=400,p_long=0.2")``."""
    rng = np.random.default_rng(seed)
    kind, a = parse_spec(arrivals)
    if kind == "poisson":
        t = poisson_arrivals(a["rate"], n, rng)
    elif kind == "renewal":
        t = renewal_arrivals(a["rate"], a.get("cv", 1.0), n, rng)
    elif kind == "mmpp":
        t = mmpp_arrivals(a["rate_on"], a.get("rate_off", 0.0), a.get("on_s", 10.0), a.get("off_s", 30.0),
                          n, rng)
    elif kind == "diurnal":
        t = diurnal_arrivals(a["rate"], a.get("amplitude", 0.5), a.get("period_s", 3600.0), n, rng)
    else:
        raise ValueError(f"synthetic arrivals {kind!r}: choose one of {', '.join(ARRIVALS)}")
    lkind, b = parse_spec(lengths)
    lo, hi = int(b.pop("lo", 1)), int(b.pop("hi", 512))
    if lkind == "lognormal":
        lens = lognormal_lengths(b.get("median", 128), b.get("sigma", 0.8), n, rng, lo, hi)
    elif lkind == "bimodal":
        lens = bimodal_lengths(b.get("short", 32), b.get("long", 400), b.get("p_long", 0.2), n, rng,
                               b.get("sigma", 0.25), lo, hi)
    elif lkind == "empirical":
        if empirical_pool is None:
            raise ValueError("synthetic lengths 'empirical' need a pool of lengths (e.g. conv-embed's)")
        lens = np.clip(empirical_lengths(empirical_pool, n, rng), lo, hi)
    elif lkind == "constant":
        lens = np.full(n, int(b.get("value", 128)), dtype=np.int64)
    else:
        raise ValueError(f"synthetic lengths {lkind!r}: choose one of {', '.join(LENGTHS)}")
    prio = priority_mix(priorities, n, rng) if priorities else np.zeros(n, dtype=np.int64)
    return Workload.from_columns(f"{kind}-{lkind}", t, lens, np.full(n, output_tokens), prio)


def named_workload(name: str, *, trace: str | None = None, rate_scale: float = 1.0, start: int = 0,
                   requests: int | None = None, lengths: str = "lognormal:median=128,sigma=0.8",
                   priorities: str = "", seed: int = 0) -> Workload:
    """What a ``--workload`` names: a synthetic spec (``requests`` rows, default 10 000, with ``lengths``
    and the ``priorities`` mix, e.g. ``'0:0.9,-1:0.1'``), else a standard workload or a trace file
    (``traces.load_workload``: rows ``start``.. of it)."""
    kind = parse_spec(name)[0] if ":" in name or name in ARRIVALS else ""
    if kind in ARRIVALS and not Path(name).is_file():
        pool = conv_embed(trace).input_tokens if lengths.startswith("empirical") else None
        prio = {int(k): float(v) for k, v in (x.split(":") for x in priorities.split(",") if x)}
        wl = synthetic_workload(name, requests or 10_000, lengths, seed, priorities=prio or None,
                                empirical_pool=pool)
        return wl.scale_rate(rate_scale) if rate_scale != 1.0 else wl
    return load_workload(name, rate_scale, start, requests, trace)
