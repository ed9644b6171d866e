"""How many intra-op threads a batch runs on, chosen by its size from a measurement on this machine.

    choose_thread_plan(run_tokens, cores) -> ThreadPlan     measured (the executor's forward at each count)
    ThreadPlan.threads_for(tokens) -> int                    the count for a batch of ``tokens``
    ThreadPlan.apply(tokens)                                 sets torch's pool for the calling thread

More threads are not always faster. On small batches an intra-op pool pays a wake-up and a barrier per
op, on a virtual machine an idle vCPU can be slow to wake, and the two-thread time of a small batch
moves with what else runs on the other core (the front end, the load generator). Whether a second
thread pays on a lone short input, and from what batch size on, differs between machines (even VMs
sold as the same CPU): it is measured, never assumed (``benchmarks/threads.py`` prints this machine's).

The plan: probe shapes from a lone short input to a large batch, each timed at every candidate count
(1, then doubling, up to ``cores``; the counts interleaved, median of ``repeats`` after a warm-up). A
shape's choice is the fewest threads within ``margin`` of the fastest (fewer threads leave cores to
the front end); a batch uses the choice of the largest probe shape not larger than it, and choices
never fall as batches grow.
``batchpilot profile`` stores the plan in the profile (``to_json``) and ``serve --profile`` runs that
plan, so the profile's prices are the server's; an explicit ``--threads N`` fixes the count instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROBE_SHAPES = ((1, 16), (1, 64), (1, 160), (2, 160), (4, 128), (8, 128))  # (batch, tokens): 16..1024
MARGIN = 0.05


@dataclass(frozen=True)
class ThreadPlan:
    """``steps``: (min_tokens, threads), min_tokens ascending from 0, threads non-decreasing."""

    steps: tuple[tuple[int, int], ...]
    # probe tokens -> {threads: ms}
    measured: dict[int, dict[int, float]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.steps or self.steps[0][0] != 0:
            raise ValueError(f"a thread plan starts at 0 tokens: {self.steps}")
        if any(t < 1 for _, t in self.steps):
            raise ValueError(f"a thread plan's counts are >= 1: {self.steps}")
        if any(b[0] <= a[0] or b[1] < a[1] for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("a thread plan's steps ascend in tokens and never fall in threads: "
                             f"{self.steps}")

    @classmethod
    def fixed(cls, threads: int) -> ThreadPlan:
        return cls(((0, int(threads)),))

    @property
    def max_threads(self) -> int:
        return self.steps[-1][1]

    def threads_for(self, tokens: int) -> int:
        out = self.steps[0][1]
        for lo, threads in self.steps:
            if tokens < lo:
                break
            out = threads
        return out

    def apply(self, tokens: int) -> int:
        """Set torch's intra-op pool (of the calling thread) for a batch of ``tokens``; returns the count."""
        import torch

        n = self.threads_for(tokens)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def describe(self) -> str:
        if len(self.steps) == 1:
            return f"{self.steps[0][1]} threads"
        parts = [f"{t} from {lo} tokens" if lo else f"{t}" for lo, t in self.steps]
        return "threads by batch tokens: " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"steps": [list(s) for s in self.steps],
                "measured_ms": {str(k): {str(t): round(ms, 3) for t, ms in v.items()}
                                for k, v in self.measured.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ThreadPlan:
        measured = {int(k): {int(t): float(ms) for t, ms in v.items()}
                    for k, v in (data.get("measured_ms") or {}).items()}
        return cls(tuple((int(lo), int(t)) for lo, t in data["steps"]), measured)


def candidate_counts(cores: int) -> list[int]:
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return [*out, max(int(cores), 1)]


def plan_from_times(times: dict[int, dict[int, float]], margin: float = MARGIN) -> ThreadPlan:
    """The plan from measured ms per (batch tokens, threads): the pure half of ``choose_thread_plan``."""
    steps: list[tuple[int, int]] = []
    for tokens in sorted(times):
        by = times[tokens]
        best = min(by.values())
        pick = min(t for t, ms in by.items() if ms <= best * (1.0 + margin))
        pick = max(pick, steps[-1][1] if steps else 1)
        if not steps:
            steps.append((0, pick))
        elif pick > steps[-1][1]:
            steps.append((tokens, pick))
    return ThreadPlan(tuple(steps) or ((0, 1),), dict(times))


def choose_thread_plan(run: Callable[[int, int], None], cores: int, repeats: int = 2,
                       shapes: tuple[tuple[int, int], ...] = PROBE_SHAPES,
                       max_length: int = 512) -> ThreadPlan:
    """Time ``run(batch, tokens)`` (one forward of ``batch`` inputs of ``tokens`` tokens each) at each
    candidate thread count; the plan the times give (``plan_from_times``). One core: 1 thread, unmeasured."""
    import torch

    counts = candidate_counts(cores)
    if counts == [1]:
        return ThreadPlan.fixed(1)
    times: dict[int, dict[int, float]] = {}
    try:
        for n, length in shapes:
            length = min(length, max_length)
            samples: dict[int, list[float]] = {t: [] for t in counts}
            for r in range(repeats + 1):  # the counts interleaved; round 0 warms each up
                for threads in counts:
                    torch.set_num_threads(threads)
                    t0 = time.perf_counter()
                    run(n, length)
                    if r:
                        samples[threads].append(time.perf_counter() - t0)
            times[n * length] = {t: statistics.median(s) * 1e3 for t, s in samples.items()}
    finally:
        torch.set_num_threads(max(counts))
    return plan_from_times(times)


def plan_for(executor: Any, num_threads: int | None, plan: ThreadPlan | None = None) -> ThreadPlan:
    """The plan ``executor`` runs: ``num_threads`` fixed when given, else ``plan`` (a profile's), else
    measured now on the executor's own padding-free (or padded) forward."""
    if num_threads is not None:
        return ThreadPlan.fixed(num_threads)
    fixed = ThreadPlan.fixed(int(getattr(executor, "num_threads", 1) or 1))
    if getattr(executor, "backend", "torch") != "torch" or getattr(executor.device, "type", "cpu") != "cpu":
        return fixed  # onnxruntime sizes its pool once; on a GPU the host threads do not run the forward
    if plan is not None:
        return plan
    from batchpilot.models.device import available_cores
    from batchpilot.models.encoder import make_batch

    padding = "none" if getattr(executor, "supports_padding_free", lambda: False)() else "dynamic"
    row_id = int(getattr(executor, "pad_id", 0) or 0) + 1000

    def run(n: int, length: int) -> None:
        executor.run(executor.prepare(make_batch([[row_id] * length] * n, padding, executor.max_length)))

    executor.threads = None  # while measuring, each forward runs on the count the probe set
    return choose_thread_plan(run, available_cores(), max_length=int(executor.max_length))
