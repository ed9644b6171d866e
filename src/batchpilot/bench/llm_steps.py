"""The LLM engine's step log (``serve --llm --llm-step-log PATH``) and how its steps ran against a profile.

``runtime.llm_engine.StepLog`` appends one JSON line per engine step: ``step``, ``start``
(``time.perf_counter()`` when it was scheduled), ``wall_s`` (the whole step: schedule, forward, sample,
detokenise, deliver), ``forward_s`` (of which forward + sampling), ``seqs``, ``after_idle`` (the step
followed an idle wait) and ``features`` (the step's cost-model features). ``read_steps`` reads it
while the server writes (whole lines only).

``speed_vs_profile`` is what ``bench fidelity --workload conv-llm`` prints beside each load point: the
logged steps' seconds over what the profile (step model and serving path) predicts for the same step
shapes. It reports how fast the machine ran against its profile; nothing is fitted on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.costmodel import CostModel
from ..sim.llm_frontend import LLMFrontEnd, step_cycles


@dataclass(frozen=True)
class LoggedStep:
    start: float
    wall_s: float
    forward_s: float
    seqs: int
    after_idle: bool
    features: dict[str, float]


def read_steps(path: str | Path, offset: int = 0) -> tuple[list[LoggedStep], int]:
    """Steps logged from byte ``offset`` on (whole lines only: the server may be writing one now), and
    the offset to read from next."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    steps = []
    for line in data[:end].splitlines():
        if line.strip():
            d = json.loads(line)
            steps.append(LoggedStep(float(d["start"]), float(d["wall_s"]), float(d["forward_s"]),
                                    int(d["seqs"]), bool(d["after_idle"]),
                                    {k: float(v) for k, v in d["features"].items()}))
    return steps, offset + end


def speed_vs_profile(profile: CostModel, steps: Sequence[LoggedStep],
                     frontend: LLMFrontEnd | None = None) -> float:
    """The logged steps' seconds over the profile's for the same step shapes, minus 1 (+0.05: the steps
    took 5% longer than profiled); NaN without steps. With ``frontend`` (the profile's serving path),
    against what the simulator prices a step at, ``frontend.step_seconds``, and a step's seconds are the
    interval to the next step's start while the engine went straight on (its own ``wall_s`` before an
    idle wait: ``sim.llm_frontend.step_cycles``, as the profile measured them); without, ``wall_s``
    against the bare step model."""
    if not steps:
        return math.nan
    if frontend is None:
        predicted = sum(profile.latency(s.features) for s in steps)
        took = sum(s.wall_s for s in steps)
    else:
        predicted = sum(frontend.step_seconds(profile.latency(s.features), s.seqs) for s in steps)
        took = float(step_cycles([s.start for s in steps], [s.wall_s for s in steps],
                                 [s.after_idle for s in steps]).sum())
    return took / predicted - 1.0 if predicted > 0 else math.nan
