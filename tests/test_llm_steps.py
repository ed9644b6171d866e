"""The live step log: reading it while it grows, which intervals count, and the fit on them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchpilot.bench.llm_steps import LoggedStep, busy_intervals, fit_live_steps, read_steps
from batchpilot.core.costmodel import LLM_FEATURES, CostModel
from batchpilot.runtime.llm_engine import StepLog, StepRecord

TRUE = {"const": 0.008, "prefill_tokens": 4e-4, "decode_seqs": 6e-4, "kv_tokens": 2e-6, "prefill_attn": 0.0,
        "multi_row": 0.005}


def _feats(prefill: int, decodes: int, ctx: int) -> dict[str, float]:
    return {"const": 1.0, "prefill_tokens": float(prefill), "decode_seqs": float(decodes),
            "kv_tokens": float(decodes * ctx + prefill), "prefill_attn": float(prefill * prefill),
            "multi_row": float(prefill + decodes >= 2)}


def _cost(f: dict[str, float]) -> float:
    return sum(TRUE[k] * v for k, v in f.items())


def test_read_steps_takes_whole_lines_and_resumes(tmp_path: Path) -> None:
    log = StepLog(str(tmp_path / "s.jsonl"))
    log(StepRecord(0, 1.0, 0.01, 0.008, 1, _feats(16, 0, 0), True))
    log(StepRecord(1, 1.02, 0.01, 0.008, 2, _feats(0, 2, 40), False))
    steps, off = read_steps(tmp_path / "s.jsonl")
    assert [s.start for s in steps] == [1.0, 1.02] and steps[0].after_idle and not steps[1].after_idle
    with open(tmp_path / "s.jsonl", "a") as f:  # a line the server is still writing
        f.write(json.dumps({"start": 2.0})[:7])
    more, off2 = read_steps(tmp_path / "s.jsonl", off)
    assert more == [] and off2 == off
    log.close()
    log(StepRecord(2, 3.0, 0.01, 0.008, 1, _feats(0, 1, 9), False))  # after close: dropped, no error


def test_idle_gaps_are_not_step_costs() -> None:
    steps = [LoggedStep(0.0, 0.01, 0.009, 1, True, _feats(16, 0, 0)),
             LoggedStep(0.012, 0.01, 0.009, 1, False, _feats(0, 1, 17)),
             LoggedStep(5.0, 0.01, 0.009, 1, True, _feats(16, 0, 0)),  # after an idle wait
             LoggedStep(5.02, 0.01, 0.009, 1, False, _feats(0, 1, 17))]
    assert [round(p.latency_s, 3) for p in busy_intervals(steps)] == [0.012, 0.02]


def test_fit_recovers_speed_and_serving_costs_on_top_of_the_profile() -> None:
    """Live steps = 1.2 x the profile + 1.5 ms + 0.4 ms per decode (plus noise): the fit finds the three
    numbers and the served model predicts every step on the profile's shape."""
    profile = CostModel(LLM_FEATURES, tuple(TRUE[f] for f in LLM_FEATURES), (0.0,) * 6, meta={"source": "p"})
    rng = np.random.default_rng(0)
    t, steps = 0.0, []

    def live(f: dict[str, float]) -> float:
        return 1.2 * _cost(f) + 0.0015 + 0.0004 * f["decode_seqs"]

    for i in range(400):
        decodes = int(rng.integers(0, 9))
        prefill = int(rng.choice([0, 0, 0, 32, 128, 256])) if decodes else int(rng.integers(8, 300))
        f = _feats(prefill, decodes, int(rng.integers(20, 600)))
        cost = live(f) * float(rng.uniform(0.97, 1.03))
        steps.append(LoggedStep(t, cost * 0.9, cost * 0.8, decodes + (prefill > 0), i == 0, f))
        t += cost
    model = fit_live_steps(profile, steps)
    fit = model.meta["live_fit"]
    assert fit["points"] == 399 and model.meta["source"] == "p"
    assert fit["alpha"] == pytest.approx(1.2, rel=0.03)
    assert fit["const_s"] == pytest.approx(0.0015, abs=4e-4)
    assert fit["per_decode_s"] == pytest.approx(4e-4, abs=1e-4)
    assert max(abs(model.latency(s.features) / live(s.features) - 1) for s in steps) < 0.03
    with pytest.raises(ValueError, match="busy step intervals"):
        fit_live_steps(profile, steps[:10])
