"""Does ``tokens_sq`` price the big batches right? The grid fit with and without it, on profiles' own points.

    .venv/bin/python benchmarks/cost_features.py PROFILE.json [PROFILE.json ...]

For each `batchpilot profile` file (encoder), every grid point is predicted by a cost model fitted on
all the others (``models.profiler.leave_one_out``), once with the linear features
(``ENCODER_FEATURES``) and once with ``tokens_sq`` beside them (``PROFILED_ENCODER_FEATURES``, what
the profiler fits). Printed per profile and feature set: the median |error| over all points, and the
mean signed error and largest |error| over the points of 1,000 computed tokens or more (positive: the
fit prices them too low). Nothing is timed: the points are the profile's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from batchpilot.core.costmodel import ENCODER_FEATURES, PROFILED_ENCODER_FEATURES, ProfilePoint
from batchpilot.models.profiler import leave_one_out

BIG_TOKENS = 1000


def loo(points: list[ProfilePoint], names: tuple[str, ...]) -> list[float]:
    """Each point's relative error, measured / predicted - 1, from a fit on all the others."""
    return [1.0 / (1.0 + e) - 1.0 for e in leave_one_out(points, names)]


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    for path in sys.argv[1:]:
        doc = json.loads(Path(path).read_text())
        points = [ProfilePoint(q["features"], q["latency_s"]) for q in doc["points"]]
        big = [q["features"]["tokens"] >= BIG_TOKENS for q in doc["points"]]
        cells = []
        for label, names in (("linear", ENCODER_FEATURES), ("with tokens_sq", PROFILED_ENCODER_FEATURES)):
            errs = loo(points, names)
            on_big = [e for e, b in zip(errs, big, strict=True) if b]
            cells.append(f"{label}: median |err| {statistics.median(abs(e) for e in errs):.1%}, "
                         f"{len(on_big)} points >= {BIG_TOKENS} tokens mean {statistics.mean(on_big):+.1%} "
                         f"max |err| {max(abs(e) for e in on_big):.1%}")
        threads = doc.get("meta", {}).get("threads")
        print(f"{path} ({threads} threads)\n  " + "\n  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
