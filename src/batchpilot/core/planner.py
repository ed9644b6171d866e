"""Which waiting requests form the next batch, and how it is padded.

The scheduler hands the planner the first ``num_candidates(cap)`` requests in queue order (so the
look-ahead is bounded: ``lookahead × cap``) and says whether the head is *urgent* (it waited its
bound and must be in this batch — that is how "never let the oldest wait beyond its limit" holds).

Grouping (``PlannerConfig.grouping``):

* ``fifo``   — queue order, stopping at the first request that would break a budget;
* ``bucket`` — the candidates' most populated length bucket (the head's bucket when urgent);
* ``sorted`` — sort candidates by length and take the contiguous window with the lowest predicted
  cost per useful token (a window containing the head when urgent); useful tokens are weighted by
  what they cost unpadded, so short and long inputs compete fairly (see ``_sorted``);
* ``dp``     — partition the sorted candidates into batches minimising total predicted cost, i.e.
  cost per useful token over the window (exact DP over contiguous groups), then dispatch the
  best-scoring group (the head's if urgent).

The windows, the partition and the cache of a partition's unused groups are in ``sorted_groups``.
Padding-free (``none``), every grouping takes queue order as ``fifo`` does: such a batch costs the same
however it is grouped, so reordering would only delay the requests it passes over.

Budgets, checked for every candidate batch: ``cap`` requests; ``max_batch_tokens`` over computed tokens
(``n × padded_len`` padded, ``Σ len`` for padding ``none``); ``max_batch_memory_bytes`` against the cost
model's memory. Admission guarantees every request fits alone, so a batch is never empty.

The groupings' windows of length-sorted candidates (``partition``, ``best_group``, ``PartitionCache``)
are the file's first section.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from batchpilot.core.admission import pad_length
from batchpilot.core.bucketing import Bucketer
from batchpilot.core.config import PlannerConfig
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.core.request import Request

# -- Groups of length-sorted candidates ------------------------------------------------------------
# Contiguous groups of length-sorted candidates: what the ``sorted`` and ``dp`` groupings choose from.
#
# The planner sorts its candidates by length; a group ``(s, e)`` is the window ``lens[s:e]`` of that
# order, and ``start[e]`` is the smallest ``s`` for which the window is a feasible batch. Here:
#
# * ``partition``    — the min-total-cost split of the sorted candidates into feasible groups (``dp``);
# * ``best_group``   — the lowest-scoring group of a list of windows or of a partition (both groupings);
# * ``PartitionCache`` — the unused groups of the last partition, dispatched one by one while they apply.

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


@dataclass(slots=True)
class Plan:
    requests: list[Request]
    padded_len: int
    shape: BatchShape
    predicted_s: float

    @property
    def wasted_tokens(self) -> int:
        return self.shape.tokens - self.shape.useful_tokens


class BatchPlanner:
    def __init__(self, config: PlannerConfig, cost_model: CostModel,
                 bucketer: Bucketer | None = None) -> None:
        self.config = config
        self.cost_model = cost_model
        self.bucketer = bucketer
        self._ragged = config.padding == "none"
        self._tables_for = -1
        self._pad_tab: list[int] = []
        self._slope_tab: list[float] = []
        self._maxn_tab: list[int] = []
        self._single_tab: list[tuple[BatchShape, float]] = []
        # dp: the unused groups of the last partition, with their cost per useful token
        self._dp_cache = PartitionCache()

    def _refits(self) -> int:
        return self.bucketer.num_fits if self.bucketer is not None else 0

    def _tables(self) -> tuple[list[int], list[float], list[int]]:
        """Per length 0..max_len: padded length, per-request cost slope, budget-limited batch size.

        Built once (and again after a bucket refit) so the planner's inner loops only index lists.
        """
        fits = self._refits()
        if fits != self._tables_for:
            c0, c1, c2, c3 = self.cost_model.encoder_latency_coef
            n = self.config.max_len + 1
            self._pad_tab = [self._padded_len(x) for x in range(n)]
            self._slope_tab = [c1 + c2 * p + c3 * p * p for p in self._pad_tab]
            self._maxn_tab = [self._max_n(p) for p in self._pad_tab]
            # A batch of one is the common case at light load: its shape (frozen, so shareable) and
            # predicted latency depend only on the length, so build them once rather than per plan.
            lat = self.cost_model.batch_latency
            self._single_tab = [(BatchShape(1, p, p, p * p, x), lat(1, p, p * p))
                                for x, p in enumerate(self._pad_tab)]
            self._tables_for = fits
        return self._pad_tab, self._slope_tab, self._maxn_tab

    def num_candidates(self, cap: int) -> int:
        return cap if self.config.grouping == "fifo" else cap * self.config.lookahead

    def padded_len(self, longest: int) -> int:
        """The padded length of a batch whose longest request is ``longest`` (per padding mode)."""
        if longest <= self.config.max_len:
            return self._tables()[0][longest]
        return self._padded_len(longest)

    def _padded_len(self, longest: int) -> int:
        c = self.config
        if c.padding == "none":
            return longest
        if c.padding == "max":
            target = c.max_len
        elif c.padding == "bucket" and self.bucketer is not None:
            target = self.bucketer.edge_for(longest)
        else:
            target = longest
        return pad_length(target, c.pad_to_multiple_of, c.max_len)

    # -- cost of a candidate group -----------------------------------------------------------
    def _work(self, n: int, total: int, squares: int, longest: int) -> tuple[int, int]:
        """(computed tokens, attention work) of a group."""
        if self._ragged:
            return total, squares
        p = self.padded_len(longest)
        return n * p, n * p * p

    def _fits(self, n: int, tokens: int, attn: int) -> bool:
        c = self.config
        if c.max_batch_tokens and tokens > c.max_batch_tokens:
            return False
        return not (c.max_batch_memory_bytes and self.cost_model.batch_memory(n, tokens, attn)
                    > c.max_batch_memory_bytes)

    def plan(self, candidates: Sequence[Request], cap: int, urgent: bool = False) -> Plan:
        """Pick the batch from ``candidates`` (queue order; ``candidates[0]`` is the head)."""
        if not candidates:
            raise ValueError("planner: no candidates to plan a batch from")
        if len(candidates) == 1:  # the common case at light load: nothing to choose
            r = candidates[0]
            x = r.length
            if x > self.config.max_len:
                return self._make([r])
            # (padding-free too: its padded length is the length itself, so the table's shape is
            # exactly BatchShape.ragged([r.length]))
            # _tables() is rebuilt after a bucket refit; its check, inlined here (this runs per batch)
            b = self.bucketer
            if not self._single_tab or (b is not None and self._tables_for != b.num_fits):
                self._tables()
            shape, predicted_s = self._single_tab[x]
            return Plan([r], shape.padded_len, shape, predicted_s)
        grouping = self.config.grouping
        if grouping == "fifo" or self._ragged:
            # Padding-free, a batch costs c0 plus each member's own cost however it is grouped:
            # reordering saves nothing (a budget that cuts a batch short costs one c0) and delays the
            # requests it passes over (the tail, and the queue-order completion admission predicts).
            chosen = self._greedy(candidates, cap)
        elif grouping == "bucket":
            chosen = self._bucket(candidates, cap, urgent)
        elif grouping == "dp":
            cached = self._dp_cache.next_group(candidates, (cap, self._refits()), urgent)
            chosen = cached if cached is not None else self._sorted(candidates, cap, urgent, dp=True)
        else:
            chosen = self._sorted(candidates, cap, urgent, dp=False)
        return self._make(chosen)

    def trim(self, plan: Plan, max_s: float, keep: Callable[[Request], bool] | None = None) -> Plan:
        """``plan`` with only the requests ``keep`` takes (all without it; the head always stays), cut to
        its longest prefix (in queue order) whose predicted time is at most ``max_s``: the fair order's
        quantum and burst (``core/fair.py``)."""
        reqs = plan.requests
        if keep is not None:
            kept = [r for i, r in enumerate(reqs) if i == 0 or keep(r)]
            if len(kept) < len(reqs):
                reqs, plan = kept, self._make(kept)
        if plan.predicted_s <= max_s or len(reqs) < 2:
            return plan
        lat = self.cost_model.batch_latency
        n = total = squares = longest = 0
        for r in reqs:
            x = r.length
            total, squares, longest = total + x, squares + x * x, max(longest, x)
            tokens, attn = self._work(n + 1, total, squares, longest)
            if n and lat(n + 1, tokens, attn) > max_s:
                break
            n += 1
        return self._make(reqs[:n])

    def _make(self, reqs: list[Request]) -> Plan:
        lengths = [r.length for r in reqs]
        if self._ragged:
            shape = BatchShape.ragged(lengths)
        else:
            n, longest = len(lengths), max(lengths)
            p = self._tables()[0][longest] if longest <= self.config.max_len else self._padded_len(longest)
            shape = BatchShape(n, p, n * p, n * p * p, sum(lengths))
        pred = self.cost_model.batch_latency(shape.n, shape.tokens, shape.attn)
        return Plan(reqs, shape.padded_len, shape, pred)

    # -- groupings ---------------------------------------------------------------------------
    def _greedy(self, reqs: Sequence[Request], cap: int) -> list[Request]:
        """Take requests in the given order while every budget holds (the first always goes)."""
        out: list[Request] = []
        total = squares = longest = 0
        for r in reqs:
            if len(out) >= cap:
                break
            t2, s2, l2 = total + r.length, squares + r.length * r.length, max(longest, r.length)
            tokens, attn = self._work(len(out) + 1, t2, s2, l2)
            if out and not self._fits(len(out) + 1, tokens, attn):
                break
            out.append(r)
            total, squares, longest = t2, s2, l2
        return out

    def _bucket(self, reqs: Sequence[Request], cap: int, urgent: bool) -> list[Request]:
        if self.bucketer is None:
            return self._greedy(reqs, cap)
        of = self.bucketer.bucket_of
        ids = [of(r.length) for r in reqs]
        if urgent:
            pick = ids[0]
        else:
            counts: dict[int, int] = {}
            for b in ids:  # dict keeps first-seen order, so ties go to the bucket seen first
                counts[b] = counts.get(b, 0) + 1
            pick = max(counts, key=lambda b: counts[b])
        return self._greedy([r for r, b in zip(reqs, ids, strict=True) if b == pick], cap)

    def _sorted(self, reqs: Sequence[Request], cap: int, urgent: bool, dp: bool) -> list[Request]:
        """The ``sorted`` and ``dp`` groupings of padded batches (padding-free ones keep queue order)."""
        by_idx = [r.length for r in reqs]
        order = sorted(range(len(reqs)), key=by_idx.__getitem__)
        lens = [by_idx[i] for i in order]
        k = len(lens)
        pre = list(accumulate(lens, initial=0))
        c0, c1, c2, c3 = self.cost_model.encoder_latency_coef
        # start[e]: the smallest s such that lens[s:e] is a feasible batch; non-decreasing in e.
        start = [0] * (k + 1)
        sq = list(accumulate([x * x for x in lens], initial=0))
        # Padded, the group lens[s:e] costs c0 + (e - s) * slope[e]: every member is padded to
        # the group's last (longest) length. slope is non-decreasing in e.
        slope = [0.0] * (k + 1)
        if lens[-1] <= self.config.max_len:
            # Table lookups as comprehensions (per dispatch under load, k = lookahead × cap).
            _, slope_tab, maxn_tab = self._tables()
            slope[1:] = [slope_tab[x] for x in lens]
            room = [m if m < cap else cap for m in map(maxn_tab.__getitem__, lens)]
            start[1:] = [e - m if e > m else 0 for e, m in enumerate(room, 1)]
        else:
            for e in range(1, k + 1):
                p = self._padded_len(lens[e - 1])
                slope[e] = c1 + c2 * p + c3 * p * p
                start[e] = max(0, e - min(self._max_n(p), cap))

        def cost(s: int, e: int) -> float:
            return c0 + (e - s) * slope[e]

        head = order.index(0)
        if dp:
            groups = partition(k, start, cost, (c0, slope))
        else:
            groups = [(start[e], e) for e in range(1, k + 1)]
        # Score = predicted cost / the cost its useful tokens would have in a full, unpadded batch
        # (c0 shared by cap requests). Plain cost per useful token would favour long requests: their
        # tokens dilute the fixed per-call cost, so a window padding two short inputs up to one long
        # one would beat a window of short inputs. This score is 1.0 for a full, padding-free batch.
        fixed = c0 / cap + c1

        def score(s: int, e: int) -> float:
            ideal = (e - s) * fixed + c2 * (pre[e] - pre[s]) + c3 * (sq[e] - sq[s])
            return cost(s, e) / ideal if ideal > 0 else cost(s, e)

        best = best_group(groups, head, urgent, (c0, c1, c2, c3), fixed, pre, sq, slope)
        s, e = best
        if dp:
            self._dp_cache.store([([reqs[i] for i in sorted(order[gs:ge])], score(gs, ge))
                                  for gs, ge in groups if (gs, ge) != best], (cap, self._refits()))
        return [reqs[i] for i in sorted(order[s:e])]

    def _max_n(self, padded: int) -> int:
        """Most requests a padded batch of this length may hold under the token and memory budgets."""
        c = self.config
        n = 1 << 30
        if padded <= 0:
            return n
        if c.max_batch_tokens:
            n = min(n, c.max_batch_tokens // padded)
        if c.max_batch_memory_bytes:
            m0, m1, m2, m3 = self.cost_model.encoder_memory_coef
            per = m1 + m2 * padded + m3 * padded * padded
            if per > 0:
                n = min(n, int((c.max_batch_memory_bytes - m0) // per))
        return max(n, 1)
