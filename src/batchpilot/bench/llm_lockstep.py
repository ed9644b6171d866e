"""The lockstep serving calibration (``bench fidelity --workload conv-llm --llm-calibration lockstep``).

Session 2's method, kept for comparison with the live step fit (``bench/llm_steps.py``, the default):
on the idle server, ``k`` streams started together decode in lockstep, so each inter-token gap at the
client is one live decode step of ``k`` sequences; the gap minus the step profile's prediction is fitted
on the profile's own terms and added. It measures decode steps only, minutes before the run
(docs/loadgen.md, "Session 2").
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.costmodel import CostModel, StepShape
from ..sim.traces import Workload
from .loadgen import LoadGenConfig, build_plan, one_by_one_async, replay


@dataclass
class ServingCalibration:
    """What a decode step costs live beyond the profiled forward + sampling, per concurrency level."""

    streams: list[int]
    client_itl_s: list[float]  # median inter-token gap at the client, per level
    model_step_s: list[float]  # the step profile's prediction for the same decode step
    extra_const_s: float
    extra_per_seq_s: float
    first_token_delay_s: float = 0.0
    extra_multi_row_s: float = 0.0  # one stream's TTFT at the client minus its predicted prefill step

    def rows(self) -> list[list[Any]]:
        return [[k, round(c * 1e3, 2), round(m * 1e3, 2), round((c - m) * 1e3, 2)]
                for k, c, m in zip(self.streams, self.client_itl_s, self.model_step_s, strict=True)]


def lone_ttfts(url: str, prompt_tokens: int = 16, n: int = 7, model: str | None = None) -> list[float]:
    """TTFTs of ``n`` short streams sent one at a time (nothing else running)."""
    alone = Workload.from_columns("first-token", [0.0] * n, [prompt_tokens] * n, [2] * n)
    singles = asyncio.run(one_by_one_async(build_plan(alone, "completions"), LoadGenConfig(
        url, "completions", model=model, progress=False, scrape_interval_s=0)))
    return [r.ttft_s for r in singles if r.ok]


def first_token_delay(ttfts: list[float], cost_model: CostModel, prompt_tokens: int = 16) -> float:
    """What a lone request's TTFT holds beyond its prefill step (HTTP in, waking the engine, the first
    SSE event out): the median lone TTFT minus the step model's prefill."""
    prefill = StepShape(prompt_tokens, 0, prompt_tokens, prompt_tokens * prompt_tokens)
    return max(float(np.median(ttfts)) - cost_model.latency(prefill.features()), 0.0) if ttfts else 0.0


CAL_HEAD = ["concurrent streams", "client inter-token ms (median)", "step profile ms", "serving overhead ms"]


def calibrate_serving(url: str, cost_model: CostModel, levels: tuple[int, ...] = (1, 4, 8, 16, 32),
                      prompt_tokens: int = 16, max_tokens: int = 48,
                      max_streams: int | None = None,
                      model: str | None = None) -> tuple[CostModel, ServingCalibration]:
    """Add what streaming costs per step to the step model, measured on this server with no queueing:
    ``k`` streams started together decode in lockstep, so each one's inter-token gap is one live step of
    ``k`` decodes — forward and sampling, plus scheduling, detokenising, handing every token to the
    event loop and writing one SSE event per stream, all on the server's cores. The gap minus the
    profile's prediction for that step is fitted on the step model's own terms — ``const`` (every
    step), ``multi_row`` (k >= 2) and ``decode_seqs`` (per stream) — and added to them: a profile taken
    minutes earlier in another process can be off by 30-50% (CPU clocks, cache state), and a one-line
    ``a + b k`` fit charged a single decode the multi-row jump it never takes."""
    from ..sim.frontend import fit_line

    itl, predicted, first = [], [], math.nan
    levels = tuple(k for k in levels if max_streams is None or k <= max_streams)
    lg = LoadGenConfig(url, "completions", model=model, progress=False, scrape_interval_s=0)
    for k in levels:  # an unmeasured pass first: a fresh server's first steps of each shape run slow
        replay(build_plan(Workload.from_columns("warm-up", [0.0] * k, [prompt_tokens] * k, [8] * k),
                          "completions"), lg)
    for k in levels:
        wl = Workload.from_columns("calibration", [0.0] * k, [prompt_tokens] * k, [max_tokens] * k)
        res = replay(build_plan(wl, "completions"), lg)
        bad = [r for r in res.records if not r.ok]
        if bad:
            raise RuntimeError(f"calibration stream failed: {bad[0].status} {bad[0].error}")
        # the first gaps overlap the other streams' prefills: keep the lockstep decode part
        gaps = [g for r in res.records for g in r.itl_s[4:]]
        if k == levels[0] == 1:  # alone: TTFT = HTTP in + one prefill step + the first SSE event out
            ttfts = lone_ttfts(url, prompt_tokens, model=model) + [r.ttft_s for r in res.records if r.ok]
            first = first_token_delay(ttfts, cost_model, prompt_tokens)
        itl.append(float(np.median(gaps)))
        ctx = prompt_tokens + max_tokens // 2
        predicted.append(cost_model.latency(StepShape(0, k, k * ctx).features()))
    ks = np.array(levels, dtype=float)
    gap = np.array(itl) - np.array(predicted)
    names = cost_model.feature_names
    if 1 in levels and len(levels) >= 3 and "multi_row" in names:
        # the same three step features the gap can depend on: every step, two rows or more, per stream
        delta = np.linalg.lstsq(np.column_stack([np.ones_like(ks), (ks >= 2).astype(float), ks]), gap,
                                rcond=None)[0]
        a, m, b = (float(x) for x in delta)
    else:
        (a, b), m = fit_line(ks, gap), 0.0
    extra = {"const": a, "multi_row": m, "decode_seqs": b}
    coef = [max(c + extra.get(n, 0.0), 0.0) for n, c in zip(names, cost_model.latency_coef, strict=True)]
    served = dataclasses.replace(cost_model, latency_coef=tuple(coef),
                                 meta={**cost_model.meta, "serving_overhead": {
                                     "const_s": a, "multi_row_s": m, "per_seq_s": b}})
    return served, ServingCalibration(list(levels), itl, predicted, a, b,
                                      first if math.isfinite(first) else 0.0, m)
