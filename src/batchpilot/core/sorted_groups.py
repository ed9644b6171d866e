"""Contiguous groups of length-sorted candidates: what the ``sorted`` and ``dp`` groupings choose from.

The planner sorts its candidates by length; a group ``(s, e)`` is the window ``lens[s:e]`` of that
order, and ``start[e]`` is the smallest ``s`` for which the window is a feasible batch. Here:

* ``partition``    — the min-total-cost split of the sorted candidates into feasible groups (``dp``);
* ``best_group``   — the lowest-scoring group of a list of windows or of a partition (both groupings);
* ``PartitionCache`` — the unused groups of the last partition, dispatched one by one while they apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batchpilot.core.request import Request

_INF = float("inf")
Group = tuple[int, int]


def partition(k: int, start: list[int], cost: Callable[[int, int], float],
              padded: tuple[float, list[float]] | None) -> list[Group]:
    """Min-total-cost split of the sorted candidates into contiguous feasible groups.

    ``best[e] = min over s in [start[e], e) of best[s] + cost(s, e)``. Both cost shapes here are Monge
    (padded: c0 + (e-s)·slope[e] with slope non-decreasing; padding-free: separable), and the
    infeasible region s < start[e] is a staircase, so the leftmost optimal split is non-decreasing in
    e: each scan starts at the previous optimum instead of at start[e]. ``padded`` = (c0, slope)
    inlines the padded cost (this loop is the planner's hot spot).
    """
    best = [0.0] + [_INF] * k
    back = [0] * (k + 1)
    prev = 0
    for e in range(1, k + 1):
        b, arg = _INF, e - 1
        lo = start[e] if start[e] > prev else prev
        if padded is not None:
            a = padded[1][e]
            for s in range(lo, e):
                v = best[s] + (e - s) * a
                if v < b:
                    b, arg = v, s
            b += padded[0]
        else:
            for s in range(lo, e):
                v = best[s] + cost(s, e)
                if v < b:
                    b, arg = v, s
        best[e], back[e] = b, arg
        prev = arg
    groups: list[Group] = []
    e = k
    while e > 0:
        groups.append((back[e], e))
        e = back[e]
    return groups[::-1]


def best_group(groups: Sequence[Group], head: int, urgent: bool, coef: tuple[float, float, float, float],
               fixed: float, pre: list[int], sq: list[int], slope: list[float]) -> Group:
    """The group with the lowest score, among those holding ``head`` when ``urgent``.

    Score = predicted cost / the cost the group's useful tokens would have in a full, unpadded batch
    (``fixed`` = c0 / cap + c1 per request). ``pre`` and ``sq`` are prefix sums of the sorted lengths
    and of their squares; ``slope`` is the padded per-request cost by group end (padding-free batches
    are never reordered: ``planner``).
    The grouping runs this once per window for every dispatch under load: cost and score are inlined.
    """
    c0, c1, c2, c3 = coef
    best, best_score = (head, head + 1), _INF
    for s, e in groups:
        if urgent and not s <= head < e:
            continue
        n = e - s
        cst = c0 + n * slope[e]
        ideal = n * fixed + c2 * (pre[e] - pre[s]) + c3 * (sq[e] - sq[s])
        sc = cst / ideal if ideal > 0 else cst
        if sc < best_score:
            best, best_score = (s, e), sc
    return best


class PartitionCache:
    """The unused groups of the last DP partition, each with its score, and the key (cap, bucket refits)
    they were planned for.

    Removing one group from an optimal partition leaves an optimal partition of the rest, so while
    every cached request is still among the candidates (none cancelled, expired or pushed out of the
    look-ahead by higher-priority arrivals) the remaining groups are reused and one DP serves a whole
    look-ahead window. New arrivals join the next DP.
    """

    __slots__ = ("groups", "key")

    def __init__(self) -> None:
        self.groups: list[tuple[list[Request], float]] = []
        self.key: tuple[int, int] = (0, -1)

    def store(self, groups: list[tuple[list[Request], float]], key: tuple[int, int]) -> None:
        self.groups, self.key = groups, key

    def next_group(self, candidates: Sequence[Request], key: tuple[int, int],
                   urgent: bool) -> list[Request] | None:
        """Next group of the last partition (the head's when ``urgent``, else the best-scoring), or
        None when the partition no longer applies."""
        cache = self.groups
        if not cache or self.key != key:
            return None
        if 2 * sum(len(group) for group, _ in cache) < len(candidates):
            # The tail of a partition is its leftovers: re-plan them together with new arrivals.
            self.groups = []
            return None
        ids = {r.id for r in candidates}
        if any(r.id not in ids for group, _ in cache for r in group):
            self.groups = []
            return None
        if urgent:
            head = candidates[0]
            pick = next((i for i, (group, _) in enumerate(cache) if head in group), -1)
            if pick < 0:
                return None
        else:
            pick = min(range(len(cache)), key=lambda i: cache[i][1])
        return cache.pop(pick)[0]
