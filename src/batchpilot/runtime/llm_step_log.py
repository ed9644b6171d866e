"""``serve --llm-step-log``: a step observer that appends one JSON line per engine step to a file."""

from __future__ import annotations

import json
import threading

from .llm_records import StepRecord


class StepLog:
    """A step observer that appends one JSON line per step to ``path`` (``serve --llm-step-log``): what
    ``bench fidelity`` reads to compare the live server's steps with the step profile
    (``bench.llm_steps.speed_vs_profile``)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered (read while serving); close()
        self._lock = threading.Lock()

    def __call__(self, rec: StepRecord) -> None:
        line = json.dumps({"step": rec.step_id, "start": rec.start, "wall_s": rec.wall_s,
                           "forward_s": rec.forward_s, "seqs": rec.num_seqs, "after_idle": rec.after_idle,
                           "features": rec.features})
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()
