"""The LLM engine's step log (``serve --llm --llm-step-log PATH``) and how its steps ran against a profile.

``runtime.llm_engine.StepLog`` appends one JSON line per engine step: ``step``, ``start``
(``time.perf_counter()`` when it was scheduled), ``wall_s`` (the whole step: schedule, forward, sample,
detokenise, deliver), ``forward_s`` (of which forward + sampling), ``seqs``, ``after_idle`` (the step
followed an idle wait) and ``features`` (the step's cost-model features). ``read_steps`` reads it
while the server writes (whole lines only).

``speed_vs_profile`` is what ``bench fidelity --workload conv-llm`` prints beside each load point: the
logged steps' seconds over what the profile (step model and serving path) predicts for the same step
shapes. It reports how fast the machine ran against its profile; nothing is fitted on it.
``speed_by_seqs`` splits it by sequences per step: the forward against the profile's forward factor
(``step_alpha`` and the factor of its count of sequences, or its prefill factor) times the step's
price (``sim.llm_step_shape.StepPricer``), and the rest of the step against the serving path's
overhead line, where they part.
``python -m batchpilot.bench.llm_steps OUT [PROFILE] [--by-count] [--by-kind]`` prints it for a ``bench
fidelity --workload conv-llm`` output folder (its ``steps.jsonl``, every logged step, against
``PROFILE``, by default the ``llm_profile.json`` the command wrote there); ``--by-count`` splits it by
each count of sequences from 1 to 32 (steps of more in one row), ``--by-kind`` into decode-only steps
and steps with a prefill chunk, the two kinds whose forward the profile prices apart.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchpilot.core.costmodel import CostModel
from batchpilot.sim.llm_frontend import LLMFrontEnd, step_cycles
from batchpilot.sim.llm_step_shape import StepPricer


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
    against the bare step model; both priced by ``StepPricer``."""
    if not steps:
        return math.nan
    pricer = StepPricer(profile)
    if frontend is None:
        predicted = sum(pricer.latency(s.features) for s in steps)
        took = sum(s.wall_s for s in steps)
    else:
        predicted = sum(frontend.step_seconds(pricer.latency(s.features), s.seqs, is_prefill(s))
                        for s in steps)
        took = float(step_cycles([s.start for s in steps], [s.wall_s for s in steps],
                                 [s.after_idle for s in steps]).sum())
    return took / predicted - 1.0 if predicted > 0 else math.nan


def is_prefill(step: LoggedStep) -> bool:
    """Whether the step carried a prefill chunk (its forward is priced by ``prefill_factor``)."""
    return step.features.get("prefill_tokens", 0.0) > 0


SEQS_BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 10**9))


def speed_by_seqs(profile: CostModel, steps: Sequence[LoggedStep], frontend: LLMFrontEnd,
                  bins: Sequence[tuple[int, int]] = SEQS_BINS,
                  prefill: bool | None = None) -> list[tuple[str, int, float, float]]:
    """Per bin of sequences per step (``bins``: ``(lo, hi)`` both included, default ``SEQS_BINS``; bins
    without steps left out): ``(label, steps, forward, overhead)``, ``forward`` the steps'
    ``forward_s`` over ``frontend.forward_factor`` (the speed under load, per count of sequences and
    kind of step) times ``StepPricer``'s prediction, minus 1, ``overhead`` the rest of their cycle
    (``step_cycles`` less the forward) over ``step_const_s + step_per_seq_s * seqs``, minus 1 (NaN
    where that line is 0). ``prefill``: only the steps with a prefill chunk (True) or only the
    decode-only ones (False); every step's cycle is still its interval to the next logged step."""
    if not steps:
        return []
    seqs = np.array([s.seqs for s in steps])
    fwd = np.array([s.forward_s for s in steps])
    pricer = StepPricer(profile)
    pred = np.array([pricer.latency(s.features) * frontend.forward_factor(s.seqs, is_prefill(s))
                     for s in steps])
    cycles = step_cycles([s.start for s in steps], [s.wall_s for s in steps], [s.after_idle for s in steps])
    rest = cycles - fwd
    line = frontend.step_const_s + frontend.step_per_seq_s * seqs
    out = []
    kind = np.array([prefill is None or is_prefill(s) == prefill for s in steps])
    for lo, hi in bins:
        m = (seqs >= lo) & (seqs <= hi) & kind
        if not m.any():
            continue
        label = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")
        over = float(rest[m].sum() / line[m].sum() - 1.0) if line[m].sum() > 0 else math.nan
        out.append((label, int(m.sum()), float(fwd[m].sum() / pred[m].sum() - 1.0), over))
    return out


def format_by_seqs(rows: Sequence[tuple[str, int, float, float]]) -> str:
    return "; ".join(f"{label}: forward {f:+.1%}, overhead {o:+.1%} ({n})" for label, n, f, o in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Print ``speed_by_seqs`` for a ``bench fidelity --workload conv-llm`` output folder (and the profile
    it ran with, when it was given one with ``--profile``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    by_count, by_kind = "--by-count" in args, "--by-kind" in args
    args = [a for a in args if a not in ("--by-count", "--by-kind")]
    if len(args) not in (1, 2):
        print("usage: python -m batchpilot.bench.llm_steps OUT [PROFILE] [--by-count] [--by-kind]  (OUT: a "
              "bench fidelity --workload conv-llm folder; PROFILE: the LLM profile it ran with, "
              "OUT/llm_profile.json by default; --by-count: each count of sequences per step apart; "
              "--by-kind: decode-only steps and steps with a prefill chunk apart)")
        return 2
    out = Path(args[0])
    profile = Path(args[1]) if len(args) == 2 else out / "llm_profile.json"
    for path in (profile, out / "steps.jsonl"):
        if not path.is_file():
            print(f"llm_steps: {path} does not exist (with bench fidelity --profile P, pass P as PROFILE)")
            return 2
    steps = read_steps(out / "steps.jsonl")[0]
    bins = [(k, k) for k in range(1, 33)] + [(33, 10**9)] if by_count else SEQS_BINS
    model, frontend = CostModel.load(profile), LLMFrontEnd.from_profile(profile)
    kinds: list[tuple[str, bool | None]] = [("", None)]
    if by_kind:  # the two kinds the forward is priced apart (sim.llm_frontend)
        kinds = [("decode-only ", False), ("with a prefill chunk ", True)]
    for name, kind in kinds:
        count = sum(kind is None or is_prefill(s) == kind for s in steps)
        print(f"{count} {name}engine steps against {profile}, by sequences per step:")
        for label, n, f, o in speed_by_seqs(model, steps, frontend, bins, kind):
            print(f"  {label:>6} seqs  {n:7d} steps  forward {f:+7.1%}  overhead {o:+7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
