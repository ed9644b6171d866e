"""The LLM scheduler's ``fair`` order (``LLMSchedulerConfig.policy``): waiting sequences are admitted
from the tenant that has received the least weighted service, with the lift of ``core/fair.py``
(Virtual Token Counter, Sheng et al., OSDI 2024).

Service is what the step model prices (``core/costmodel.py``, ``LLM_FEATURES``): a step's chunk of one
sequence costs its tenant the seconds it adds to the step, less the step's fixed cost::

    prefill chunk of n tokens ending at context c:  n * prefill_tokens + c * kv_tokens + n * c * prefill_attn
    decode at context c:                            decode_seqs + c * kv_tokens

divided by the tenant's weight, charged when the chunk is scheduled (so a tenant decoding long outputs
pays for them step by step, and the next admission of the same step already sees it). Without a cost
model the prices are VTC's own: a prefill token 1, a generated token 2.

A tenant whose waiting queue was empty is lifted as ``core/fair.py`` lifts it and has a *burst*: it is
admitted ahead of the tenants not in one until it has had ``fair_burst_tokens`` prompt tokens' worth of
service more than the least counter it was lifted to (``VirtualCounters.activate``), then it repays.

Admission is reordered, and when the sequence fair order admits next finds no room (``max_num_seqs``
running, or not the blocks its prompt needs), a running sequence is preempted for it (``victim``): the
latest-arrived of the running tenant ordered last, when the waiting one is in a burst and that tenant
is not though it has sequences waiting too, or when its counter is more than a burst above the waiting
one's (so two backlogged tenants whose counters cross do not take turns preempting each other); it is
recomputed, back in the waiting queue where fair order places it. A step short of blocks for a running
sequence preempts the latest of the tenant with the highest counter (``last``). The prefill tokens a
step has after its decodes go in fair order (``prefill_shares``). Within a tenant, sequences keep
arrival order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from batchpilot.core.costmodel import CostModel
from batchpilot.core.fair import VirtualCounters
from batchpilot.core.llm.sequence import Sequence


@dataclass(frozen=True, slots=True)
class TokenPrices:
    """The marginal price of a chunk (module docstring); the units are the step model's seconds, or
    VTC's token weights by default."""

    prefill_s_per_token: float = 1.0
    decode_s_per_seq: float = 2.0
    kv_s_per_token: float = 0.0
    prefill_s_per_attn: float = 0.0

    def chunk(self, start: int, n: int, is_decode: bool) -> float:
        """A chunk of ``n`` tokens from position ``start``."""
        ctx = start + n
        if is_decode:
            return self.decode_s_per_seq + self.kv_s_per_token * ctx
        return n * self.prefill_s_per_token + ctx * self.kv_s_per_token + n * ctx * self.prefill_s_per_attn

    @classmethod
    def from_cost_model(cls, cost_model: CostModel) -> TokenPrices:
        """The prices of an LLM step model's coefficients (features it lacks price 0)."""
        coef = dict(zip(cost_model.feature_names, cost_model.latency_coef, strict=True))
        prices = cls(coef.get("prefill_tokens", 0.0), coef.get("decode_seqs", 0.0),
                     coef.get("kv_tokens", 0.0), coef.get("prefill_attn", 0.0))
        if prices.prefill_s_per_token <= 0 and prices.decode_s_per_seq <= 0 and prices.kv_s_per_token <= 0:
            return cls()  # a model that prices no token: VTC's weights
        return prices


class FairWaiting:
    """The fair order's state in one ``LLMScheduler``: the tenants' counters (``VirtualCounters``), how
    many sequences each has waiting, and which waiting sequence goes next (``pick``)."""

    def __init__(self, prices: TokenPrices | None = None, weight_of: Callable[[str], float] | None = None,
                 burst_tokens: int = 0) -> None:
        self.prices = prices or TokenPrices()
        self.weight_of = weight_of or (lambda _: 1.0)
        self.burst_tokens = burst_tokens
        self.vtc = VirtualCounters()
        self._waiting: Counter[str] = Counter()

    def allowance(self, tenant: str) -> float:
        """The tenant's burst in counter units: ``burst_tokens`` prompt tokens over its weight."""
        return self.burst_tokens * self.prices.prefill_s_per_token / self.weight_of(tenant)

    def entered(self, seq: Sequence) -> None:
        """``seq`` joined the waiting queue (new, or preempted to recompute)."""
        self._waiting[seq.tenant] += 1
        if self._waiting[seq.tenant] == 1:
            self.vtc.activate(seq.tenant, self.allowance(seq.tenant))

    def left(self, seq: Sequence) -> None:
        """``seq`` left the waiting queue (admitted, aborted or expired)."""
        left = self._waiting[seq.tenant] - 1
        if left > 0:
            self._waiting[seq.tenant] = left
            return
        del self._waiting[seq.tenant]
        self.vtc.deactivate(seq.tenant)

    def usage(self) -> dict[str, tuple[float, int]]:
        """Each tenant the order has seen: its counter (for one not backlogged, what it would be lifted
        to) and its sequences waiting; what ``GET /v1/tenants`` shows of an LLM engine's fair order."""
        waiting = self._waiting
        return {t: (c, waiting.get(t, 0)) for t, c in self.vtc.all_counters().items()}

    def charge(self, seq: Sequence, n: int) -> None:
        """``seq`` has a chunk of ``n`` tokens in this step (before its computed count advances)."""
        start = seq.num_computed_tokens
        price = self.prices.chunk(start, n, start >= seq.num_prompt_tokens)
        self.vtc.charge(seq.tenant, price / self.weight_of(seq.tenant))

    def pick(self, waiting: Seq[Sequence]) -> int:
        """The index in ``waiting`` (FCFS order) of the next sequence: the first of the tenant with the
        least counter (ties: the earlier head, then the name)."""
        heads: dict[str, int] = {}
        for i, seq in enumerate(waiting):
            if seq.tenant not in heads:
                heads[seq.tenant] = i
                if len(heads) == len(self._waiting):
                    break
        counters, key = self.vtc.counters, self.vtc.key
        best = min(heads, key=lambda t: (*key(t, counters[t]), waiting[heads[t]].arrival, t))
        return heads[best]

    def prefill_shares(self, running: Seq[Sequence], waiting: Seq[Sequence], budget: int) -> dict[int, int]:
        """A step's prefill tokens in fair order: what the decodes (one token each) leave of ``budget``
        goes to the running sequences with a prompt (or a recompute) to catch up on, and to the one
        fair order admits next, by their tenants' order (module docstring), then arrival. Seq id ->
        tokens; the admitted sequence takes its share from what is left after the running ones."""
        left = budget - sum(1 for s in running if s.num_pending_tokens <= 1)
        behind = [s for s in running if s.num_pending_tokens > 1]
        if waiting:
            behind.append(waiting[self.pick(waiting)])
        behind = self.order(behind)
        shares: dict[int, int] = {}
        for s in behind:
            n = max(0, min(s.num_pending_tokens, left))
            shares[s.seq_id] = n
            left -= n
        return shares

    def rank(self, tenant: str) -> tuple[int, float]:
        """Where the tenant stands in fair order now: in a burst or not, then its counter (one that has
        no sequence waiting keeps its own, unlifted: it is compared, not admitted)."""
        vtc = self.vtc
        return vtc.key(tenant, vtc.counters.get(tenant, vtc.lift()))

    def order(self, waiting: Seq[Sequence]) -> list[Sequence]:
        """The waiting sequences by their tenants' order, then arrival (each tenant's counter as it is
        now: the order ``pick`` takes them in while no one is charged)."""
        return sorted(waiting, key=lambda s: (*self.rank(s.tenant), s.arrival, s.seq_id))

    def last(self, running: Seq[Sequence], start: int) -> Sequence:
        """Of ``running[start:]`` (key order), the latest of the tenant with the highest counter: whom a
        step that needs blocks preempts under fair order."""
        return max(running[start:], key=lambda s: (self.rank(s.tenant)[1], s.arrival, s.seq_id))

    def victim(self, waiting: Sequence, running: Seq[Sequence]) -> Sequence | None:
        """The running sequence to preempt for ``waiting`` (the one fair order admits next) when it finds
        no room, or None (module docstring)."""
        mine = self.rank(waiting.tenant)
        backlogged = self.vtc.backlogged
        worst: tuple[tuple[int, float], Sequence] | None = None
        for seq in running:  # key (arrival) order: the last of a tenant is its latest
            if seq.tenant == waiting.tenant:
                continue
            k = self.rank(seq.tenant)
            if worst is None or k >= worst[0]:
                worst = (k, seq)
        if worst is None:
            return None
        (flag, counter), seq = worst
        # out of its burst with more waiting (a tenant whose every sequence runs has no burst to be out
        # of), or more than a burst ahead
        if (mine[0] == 0 and flag == 1 and seq.tenant in backlogged) \
                or counter > mine[1] + self.allowance(waiting.tenant):
            return seq
        return None
