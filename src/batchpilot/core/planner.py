"""Which waiting requests form the next batch, and how it is padded.

The scheduler hands the planner the first ``num_candidates(cap)`` requests in queue order (so the
look-ahead is bounded: ``lookahead × cap``) and says whether the head is *urgent* (it waited its
bound and must be in this batch — that is how "never let the oldest wait beyond its limit" holds).

Grouping (``PlannerConfig.grouping``):

* ``fifo``   — queue order, stopping at the first request that would break a budget;
* ``bucket`` — the candidates' most populated length bucket (the head's bucket when urgent);
* ``sorted`` — sort candidates by length and take the contiguous window with the lowest predicted
  cost per useful token (a window containing the head when urgent);
* ``dp``     — partition the sorted candidates into batches minimising total predicted cost (exact DP
  over contiguous groups), then dispatch the cheapest group per useful token (the head's if urgent).

Budgets, checked for every candidate batch: ``cap`` requests; ``max_batch_tokens`` over computed tokens
(``n × padded_len`` padded, ``Σ len`` for padding ``none``); ``max_batch_memory_bytes`` against the cost
model's memory. Admission guarantees every request fits alone, so a batch is never empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .admission import pad_length
from .bucketing import Bucketer
from .config import PlannerConfig
from .costmodel import BatchShape, CostModel
from .request import Request

_INF = float("inf")


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

    def num_candidates(self, cap: int) -> int:
        return cap if self.config.grouping == "fifo" else cap * self.config.lookahead

    def padded_len(self, longest: int) -> int:
        """The padded length of a batch whose longest request is ``longest`` (per padding mode)."""
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
        grouping = self.config.grouping
        if grouping == "fifo" or len(candidates) == 1:
            chosen = self._greedy(candidates, cap)
        elif grouping == "bucket":
            chosen = self._bucket(candidates, cap, urgent)
        else:
            chosen = self._sorted(candidates, cap, urgent, dp=grouping == "dp")
        return self._make(chosen)

    def _make(self, reqs: list[Request]) -> Plan:
        lengths = [r.length for r in reqs]
        if self._ragged:
            shape = BatchShape.ragged(lengths)
        else:
            shape = BatchShape.padded(lengths, self.padded_len(max(lengths)))
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
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].length)
        lens = [reqs[i].length for i in order]
        k = len(lens)
        pre = [0] * (k + 1)
        sq = [0] * (k + 1)
        for i, x in enumerate(lens):
            pre[i + 1] = pre[i] + x
            sq[i + 1] = sq[i] + x * x
        # start[e]: the smallest s such that lens[s:e] is a feasible batch (non-decreasing in e).
        start = [0] * (k + 1)
        s = 0
        for e in range(1, k + 1):
            s = max(s, e - cap)
            while s < e - 1:
                tokens, attn = self._work(e - s, pre[e] - pre[s], sq[e] - sq[s], lens[e - 1])
                if self._fits(e - s, tokens, attn):
                    break
                s += 1
            start[e] = s
        lat = self.cost_model.batch_latency

        def cost(s: int, e: int) -> float:
            tokens, attn = self._work(e - s, pre[e] - pre[s], sq[e] - sq[s], lens[e - 1])
            return lat(e - s, tokens, attn)

        head = order.index(0)
        if dp:
            groups = self._partition(k, start, cost)
        else:
            groups = [(start[e], e) for e in range(1, k + 1)]
        best, best_score = (head, head + 1), _INF
        for s, e in groups:
            if urgent and not s <= head < e:
                continue
            score = cost(s, e) / (pre[e] - pre[s])
            if score < best_score:
                best, best_score = (s, e), score
        s, e = best
        return [reqs[i] for i in sorted(order[s:e])]

    @staticmethod
    def _partition(k: int, start: list[int], cost: Callable[[int, int], float]) -> list[tuple[int, int]]:
        """Min-total-cost split of the sorted candidates into contiguous feasible groups."""
        best = [0.0] + [_INF] * k
        back = [0] * (k + 1)
        for e in range(1, k + 1):
            b, arg = _INF, e - 1
            for s in range(start[e], e):
                v = best[s] + cost(s, e)
                if v < b:
                    b, arg = v, s
            best[e], back[e] = b, arg
        groups: list[tuple[int, int]] = []
        e = k
        while e > 0:
            groups.append((back[e], e))
            e = back[e]
        return groups[::-1]
