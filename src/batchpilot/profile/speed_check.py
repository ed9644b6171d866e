"""``batchpilot profile --recheck p.json``: how fast this machine runs the profile's own batches now.

A profile is one look at the machine's speed. On shared or changing hardware that speed moves by
tens of percent between minutes, and a prediction made from an older look inherits the difference
(docs/benchmarks.md, Fidelity). A full profile takes minutes; the recheck takes seconds: it loads the
model as the profile ran it (precision, backend, thread plan from the profile's meta), times the
profile's smaller grid batches again (the same input lengths, round-robin, median of ``repeats``
calls each, as ``models/profiler.py`` timed them), and compares each with the time the profile
measured for it. The median of those ratios is the machine's speed against the profile
(``SpeedCheck.ratio``: 1.10 = batches take 10% longer now).

``rescaled(doc, check)`` is the profile at that speed: every batch-time term multiplied by the ratio
(the cost model's latency coefficients and the serving path's per-batch constant; the loaded-phase
factors are relative and stay), memory and the serving path's per-request costs unchanged, and the
check itself recorded under ``"speed_check"``. It is a profile like any other: ``serve``,
``simulate`` and ``tune`` read it as they read the original. ``bench fidelity`` runs a recheck right
before each point, before any of its traffic, and predicts from it.

torch is imported lazily: ``batchpilot --help`` must work without it.
"""

from __future__ import annotations

import copy
import datetime
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

MAX_TOKENS = 1024  # the grid batches rechecked: up to this many tokens (the small, frequent ones)
MIN_BATCHES = 4


@dataclass(frozen=True)
class SpeedCheck:
    ratio: float  # median over the rechecked batches of (time now / time in the profile)
    batches: list[dict[str, Any]] = field(default_factory=list)  # n, lengths, profile_s, now_s, ratio

    @property
    def speed(self) -> float:
        """``ratio - 1``: +0.10 = 10% slower than the profile, the sign ``bench fidelity`` reports."""
        return self.ratio - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "spread": self.spread(), "batches": self.batches}

    def spread(self) -> list[float]:
        """The lowest and highest ratio of one batch: how evenly the machine's speed moved."""
        ratios = [b["ratio"] for b in self.batches]
        return [min(ratios), max(ratios)] if ratios else []


def reference_batches(doc: dict[str, Any], max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """The profile's grid points of up to ``max_tokens`` tokens (at least the ``MIN_BATCHES`` smallest):
    their input lengths, padding and the median time the profile measured."""
    points = [p for p in doc.get("points", []) if p.get("latency_s", 0) > 0 and p.get("lengths")]
    if not points:
        raise ValueError("the profile holds no measured grid points to recheck")
    full = [dict(p, lengths=_lengths(p)) for p in points]
    full.sort(key=lambda p: sum(p["lengths"]))
    small = [p for p in full if sum(p["lengths"]) <= max_tokens]
    return small if len(small) >= MIN_BATCHES else full[:MIN_BATCHES]


def _lengths(point: dict[str, Any]) -> list[int]:
    """A grid point's input lengths (a uniform point stores one length for all ``n``)."""
    lengths = [int(x) for x in point["lengths"]]
    return lengths * int(point["n"]) if len(lengths) == 1 and int(point["n"]) > 1 else lengths


def check_speed(executor: Any, doc: dict[str, Any], repeats: int = 5, seed: int = 0) -> SpeedCheck:
    """Time the profile's reference batches on ``executor`` (round-robin, one warm-up call each, the
    median of ``repeats``) and compare each with the profile's own time for it."""
    from batchpilot.models.profiler import TimedBatch

    if repeats < 1:
        raise ValueError(f"recheck: repeats must be >= 1, got {repeats}")
    rng = random.Random(seed)
    refs = reference_batches(doc)
    shapes = [TimedBatch(executor, ref["lengths"], ref.get("padding", "dynamic"), rng, memory=False)
              for ref in refs]
    for _ in range(repeats):
        for s in shapes:
            s.time_once()
    batches = []
    for ref, s in zip(refs, shapes, strict=True):
        now = statistics.median(s.total)
        batches.append({"n": len(ref["lengths"]), "lengths": ref["lengths"], "profile_s": ref["latency_s"],
                        "now_s": now, "ratio": now / ref["latency_s"]})
    return SpeedCheck(statistics.median(b["ratio"] for b in batches), batches)


def rescaled(doc: dict[str, Any], check: SpeedCheck, source: str = "") -> dict[str, Any]:
    """The profile ``doc`` at the speed ``check`` measured (see the module doc); ``doc`` is unchanged."""
    out = copy.deepcopy(doc)
    r = check.ratio / float(doc.get("speed_check", {}).get("ratio", 1.0))  # a rechecked one: undo its own
    cm = out["cost_model"]
    cm["latency_coef"] = [c * r for c in cm["latency_coef"]]
    if out.get("kind") == "llm" and "step_points" in cm.get("meta", {}):
        # the grid keeps its own times (the next recheck compares against them); the step model's shape
        # table reads them at this speed (``sim.llm``)
        cm["meta"]["step_points_speed"] = check.ratio
    llm = out.get("kind") == "llm"
    part = (out.get("service") or {}) if llm else (out.get("service") or {}).get("batch") or {}
    for key in ("step_const_s", "step_per_seq_s") if llm else ("const_s",):
        if key in part:  # seconds per batch or step: the machine's speed moves them too
            part[key] *= r
    out["speed_check"] = {"of": source, "date": datetime.datetime.now(datetime.timezone.utc)
                          .isoformat(timespec="seconds"), **check.to_dict()}
    return out


def load_like(doc: dict[str, Any], cache_dir: str | None = None) -> Any:
    """The executor the profile measured: its model, precision, backend and thread plan (meta);
    ``cache_dir``: where an ONNX export is cached (the profile's folder)."""
    from batchpilot.core.costmodel import CostModel
    from batchpilot.models.tasks import load_model
    from batchpilot.server.build import profiled_threads

    cm = CostModel.from_dict(doc["cost_model"])
    dtype = cm.meta.get("dtype", "float32")
    executor = load_model(doc.get("meta", {}).get("model_path"), None, "embed", cm.meta.get("max_length"),
                          None, dtype, cm.meta.get("precision_min_cosine", 0.999),
                          cm.meta.get("backend", "torch"), cache_dir, profiled_threads(cm, dtype))
    executor.warmup()
    return executor


def check_llm_speed(doc: dict[str, Any], repeats: int = 5) -> SpeedCheck:
    """The LLM step profile's own steps (``cost_model.meta.step_points``, those it measured under 50 ms)
    timed again on a runner built as the profile's (model, device, precision, threads)."""
    from batchpilot.profile.llm import recheck_steps
    from batchpilot.runtime.llm.build import build_llm_engine

    meta = doc["cost_model"].get("meta", {})
    points = meta.get("step_points")
    if not points:
        raise ValueError("the LLM profile holds no step points to recheck; profile it again")
    engine = build_llm_engine(meta.get("model_path"), device=str(meta.get("device", "cpu")),
                              dtype=str(meta.get("dtype", "float32")), threads=int(meta.get("threads", 0)),
                              start=False)
    now = recheck_steps(engine.runner, points, repeats)
    batches = [{"n": p["decodes"] + len(p["prefills"]), "lengths": p["prefills"], "decodes": p["decodes"],
                "context": p["context"], "profile_s": p["latency_s"], "now_s": t,
                "ratio": t / p["latency_s"]} for p, t in zip(points, now, strict=True) if math.isfinite(t)]
    return SpeedCheck(statistics.median(b["ratio"] for b in batches), batches)


def recheck(source: str, output: str, repeats: int = 5, seed: int = 0) -> SpeedCheck:
    """``batchpilot profile --recheck source -o output``: check the speed, write the rescaled profile."""
    import json
    from pathlib import Path

    if Path(source).resolve() == Path(output).resolve():
        raise ValueError(f"--recheck {source}: give another --output; the rechecked profile keeps its source")
    doc = json.loads(Path(source).read_text())
    if doc.get("kind") == "llm":
        check = check_llm_speed(doc, repeats)
    else:
        check = check_speed(load_like(doc, str(Path(source).resolve().parent)), doc, repeats, seed)
    Path(output).write_text(json.dumps(rescaled(doc, check, str(source)), indent=2))
    lo, hi = check.spread()
    print(f"speed vs {source}: {check.speed:+.1%} (median of {len(check.batches)} batches, one batch "
          f"{lo - 1:+.1%} .. {hi - 1:+.1%}); wrote {output}, its batch times x{check.ratio:.3f}")
    return check
