"""A batch after an idle slot costs more than one right after another: the profile's cold-start curve.

The profile's grid times each shape back to back, so its cost model prices a batch whose slot has just
run another one: the weights and the thread pool are warm. A live server is often idle between
batches, and while it sits idle the weights leave the CPU's caches (on a shared machine, the
neighbours' work evicts them) and its threads go to sleep; the next batch pays to bring them back.
On a server whose load comes and goes, those batches are the common case, so a warm price alone
under-prices them.

``measure_cold`` times one lone batch (about ``COLD_LENGTH`` tokens, the profiled padding mode) after
each idle gap of ``COLD_GAPS_S``, ``rounds`` times in a seeded shuffled order, each sample after two
warm calls of the same batch. A gap's extra is the median of its samples less the median with no
gap, clipped at 0, then made non-decreasing in the gap (pooled adjacent violators: a longer idle
never costs less). The ``FrontEnd`` adds that extra, interpolated, to every batch by the time the
server sat with no batch running before it (``FrontEnd.cold_seconds``), in the simulator and in the
fit of the profile's loaded batches.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

COLD_GAPS_S = (0.0, 0.005, 0.02, 0.1, 0.4)
COLD_ROUNDS = 20  # ~15 s with MiniLM on one CPU core; a sample's noise here is as large as the effect
COLD_LENGTH = 64


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def measure_cold(executor: Any, ids: list[int], padding: str, rounds: int | None = None,
                 gaps_s: Sequence[float] | None = None, seed: int = 0,
                 sleep: Any = time.sleep) -> tuple[tuple[float, ...], tuple[float, ...], dict[str, Any]]:
    """The cold-start curve of ``executor`` on a lone batch of the token ids ``ids`` (about
    ``COLD_LENGTH`` of them): ``(gaps_s, extra_s, details)`` (module docstring); ``rounds`` and
    ``gaps_s`` default to ``COLD_ROUNDS`` and ``COLD_GAPS_S``."""
    from .encoder import make_batch

    rounds = COLD_ROUNDS if rounds is None else rounds
    gaps_s = COLD_GAPS_S if gaps_s is None else gaps_s
    if rounds < 1 or not gaps_s or min(gaps_s) != 0.0:
        raise ValueError(f"cold start: rounds >= 1 and gaps starting at 0 are needed, got {rounds}, {gaps_s}")

    batch = make_batch([list(ids)], padding, int(executor.max_length))

    def once() -> float:
        t0 = time.perf_counter()
        executor.run(executor.prepare(batch))  # what the grid times: prepare + run
        return time.perf_counter() - t0

    rng = random.Random(seed)
    samples: dict[float, list[float]] = {float(g): [] for g in gaps_s}
    once()  # the shape's first call allocates
    for _ in range(rounds):
        order = list(samples)
        rng.shuffle(order)
        for gap in order:
            once()
            once()
            if gap > 0:
                sleep(gap)
            samples[gap].append(once())
    medians = {g: statistics.median(s) for g, s in samples.items()}
    gaps = sorted(medians)
    warm = medians[gaps[0]]
    extra = nondecreasing([max(medians[g] - warm, 0.0) for g in gaps])
    details = {"length": len(ids), "padding": padding, "rounds": rounds,
               "median_s": {f"{g:g}": medians[g] for g in gaps}, "extra_s": extra}
    return tuple(gaps), tuple(extra), details


def measure_cold_on(executor: Any, texts: Sequence[str], lengths: Sequence[int],
                    padding: str) -> tuple[tuple[float, ...], tuple[float, ...], dict[str, Any]]:
    """``measure_cold`` on the one of ``texts`` (of token ``lengths``) nearest ``COLD_LENGTH`` tokens."""
    near = min(range(len(lengths)), key=lambda i: abs(lengths[i] - COLD_LENGTH))
    return measure_cold(executor, executor.tokenize([texts[near]])[0], padding)
