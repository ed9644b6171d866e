"""``serve --llm-step-log``: a step observer that appends one JSON line per engine step to a file.

The engine thread only queues the step's record; a writer thread formats and writes the lines
(``json_lines.JsonLines``: a write on the engine thread would slow the steps it logs).
"""

from __future__ import annotations

from typing import Any

from batchpilot.runtime.json_lines import JsonLines
from batchpilot.runtime.llm_records import StepRecord


def step_line(rec: StepRecord) -> dict[str, Any]:
    """One step's line: what ``bench.llm_steps.read_steps`` reads back."""
    return {"step": rec.step_id, "start": rec.start, "wall_s": rec.wall_s, "forward_s": rec.forward_s,
            "seqs": rec.num_seqs, "after_idle": rec.after_idle, "features": rec.features}


class StepLog:
    """A step observer that appends one JSON line per step to ``path`` (``serve --llm-step-log``): what
    ``bench fidelity`` reads to compare the live server's steps with the step profile
    (``bench.llm_steps.speed_vs_profile``). Lines are written by a thread of their own, within
    ``json_lines.FLUSH_S`` of their step; ``flush()`` writes them now, ``close()`` writes and closes."""

    def __init__(self, path: str) -> None:
        self._lines = JsonLines(path, step_line, name="llm-step-log")

    def __call__(self, rec: StepRecord) -> None:
        self._lines.append(rec)

    def flush(self) -> None:
        self._lines.flush()

    def close(self) -> None:
        self._lines.close()
