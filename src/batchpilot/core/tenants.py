"""Tenants: what each may use (its weight and quotas) and what each has used.

A tenant is whoever a request is for (``Request.tenant``): a key of the server's keys file, or, without
one, the client's own name for itself. The table of tenants (``TenantTable``) gives each a
``TenantSpec``: its weight under the ``fair`` queue order (``core/fair.py``) and its quotas; a tenant the
table does not name gets the table's ``default``. The ledger (``TenantLedger``) is the scheduler's
per-tenant state: requests in progress, the token bucket of the token quota, and usage counters.

Quotas, checked by admission (``AdmissionController.check_group``) for a whole request at once:

* ``tokens_per_s``: a token bucket of ``burst_tokens`` (default: one second's worth) refilled at that
  rate, charged a request's input tokens when it is admitted. Over any window of ``w`` seconds a tenant
  is admitted at most ``burst + tokens_per_s * w`` tokens. A refusal says when the bucket will hold the
  request's tokens (the server's ``Retry-After``); a request larger than the burst is refused for good.
* ``max_concurrent_requests``: requests admitted and not finished.

Nothing here reads a clock: ``now`` is the caller's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from batchpilot.core.bucket import TokenBucket
from batchpilot.core.request import DEFAULT_TENANT

# Tenants not in the table are forgotten once this many are tracked and they are idle (nothing in
# progress, a full bucket): a server that takes the tenant from the client's own header must not grow
# without bound. What is forgotten is usage counters; quotas and fair counters come back as for a new one.
MAX_TRACKED_TENANTS = 4096


@dataclass(frozen=True)
class TenantSpec:
    """One tenant's share and limits (0 = no limit)."""

    weight: float = 1.0  # its share of the machine under the fair order, relative to the others'
    tokens_per_s: float = 0.0  # input tokens admitted per second (a token bucket)
    burst_tokens: int = 0  # the bucket's size; 0: one second of tokens_per_s
    max_concurrent_requests: int = 0  # requests admitted and not finished

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"tenant weight must be a finite number > 0, got {self.weight}")
        if not (self.tokens_per_s >= 0 and math.isfinite(self.tokens_per_s)):
            raise ValueError(f"tenant tokens_per_s must be >= 0 (0 = no quota), got {self.tokens_per_s}")
        if self.burst_tokens < 0 or self.max_concurrent_requests < 0:
            raise ValueError("tenant burst_tokens and max_concurrent_requests must be >= 0 (0 = none)")

    @property
    def burst(self) -> float:
        """The token bucket's size."""
        return float(self.burst_tokens or max(1, math.ceil(self.tokens_per_s)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "tenant") -> TenantSpec:
        data = dict(data or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class TenantTable:
    """The tenants a deployment names, and the spec of any other."""

    specs: Mapping[str, TenantSpec] = field(default_factory=dict)
    default: TenantSpec = TenantSpec()

    def spec(self, tenant: str) -> TenantSpec:
        return self.specs.get(tenant, self.default)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self.specs


Quota = Literal["tokens", "concurrency"]


@dataclass(frozen=True, slots=True)
class QuotaRefusal:
    """Why a tenant's request is over its quota; ``retry_after_s`` None when waiting would not help
    (or, for concurrency, when only the caller can tell how long)."""

    quota: Quota
    message: str
    retry_after_s: float | None = None


@dataclass(slots=True)
class TenantState:
    """One tenant's running state in a scheduler."""

    spec: TenantSpec
    bucket: TokenBucket | None = None
    in_progress: int = 0  # requests admitted and not finished
    requests: int = 0  # requests admitted
    tokens: int = 0  # input tokens admitted
    rejected: Counter[str] = field(default_factory=Counter)  # by RejectReason value

    def is_idle(self, now: float) -> bool:
        return self.in_progress == 0 and (self.bucket is None or self.bucket.level(now) >= self.bucket.burst)


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant as a scheduler or an LLM engine sees it (``BatchScheduler.tenant_usage``): its spec,
    what it has used, its counter under the fair order (None under another order, or where the reader
    cannot see it) and its quota state."""

    tenant: str
    weight: float
    requests: int  # admitted
    tokens: int  # input tokens admitted
    in_progress: int
    waiting: int  # inputs waiting (fair order only; else 0)
    counter: float | None  # weighted tokens dispatched (the fair order's virtual token counter)
    tokens_per_s: float  # the quota (0 = none)
    bucket_tokens: float | None  # what its token bucket holds now (None: no token quota)
    max_concurrent_requests: int
    rejected: dict[str, int]

    @classmethod
    def of(cls, name: str, st: TenantState, now: float, counter: float | None = None,
           waiting: int = 0) -> TenantUsage:
        spec = st.spec
        return cls(name, spec.weight, st.requests, st.tokens, st.in_progress, waiting, counter,
                   spec.tokens_per_s, st.bucket.level(now) if st.bucket is not None else None,
                   spec.max_concurrent_requests, dict(st.rejected))


def _over_burst(tenant: str, tokens: int, spec: TenantSpec) -> QuotaRefusal:
    return QuotaRefusal("tokens", f"the request has {tokens} tokens, more than tenant {tenant!r}'s token "
                        f"burst of {spec.burst:.0f} (burst_tokens): it can never be admitted; split it or "
                        "raise burst_tokens")


def _bucket(spec: TenantSpec) -> TokenBucket | None:
    return TokenBucket(spec.tokens_per_s, spec.burst) if spec.tokens_per_s > 0 else None


class TenantLedger:
    """Per-tenant quotas and usage for one scheduler: ``check`` (no side effect), ``admit``, ``leave``,
    ``refused``; ``set_table`` applies a reloaded table (buckets keep what they hold, up to the new burst)."""

    def __init__(self, table: TenantTable | None = None) -> None:
        self.table = table or TenantTable()
        self._states: dict[str, TenantState] = {}
        self._busy_weight = 0.0  # the weights of the tenants with a request in progress, summed
        self._num_busy = 0  # those tenants

    def __iter__(self) -> Iterator[tuple[str, TenantState]]:
        return iter(sorted(self._states.items()))

    def __len__(self) -> int:
        return len(self._states)

    def weight(self, tenant: str) -> float:
        state = self._states.get(tenant)
        return state.spec.weight if state is not None else self.table.spec(tenant).weight

    def state(self, tenant: str) -> TenantState:
        state = self._states.get(tenant)
        if state is None:
            spec = self.table.spec(tenant)
            state = self._states[tenant] = TenantState(spec, _bucket(spec))
        return state

    def set_table(self, table: TenantTable, now: float) -> None:
        """Apply a new table (a reloaded keys file) to every tracked tenant."""
        self.table = table
        for name, state in self._states.items():
            spec = table.spec(name)
            if state.in_progress:
                self._busy_weight += spec.weight - state.spec.weight
            state.spec = spec
            if spec.tokens_per_s <= 0:
                state.bucket = None
            elif state.bucket is None:
                state.bucket = _bucket(spec)
            else:
                state.bucket.reshape(spec.tokens_per_s, spec.burst, now)

    def check(self, tenant: str, tokens: int, now: float) -> QuotaRefusal | None:
        """Whether a request of ``tokens`` input tokens is within the tenant's quotas (charges nothing)."""
        state = self._states.get(tenant)
        spec = state.spec if state is not None else self.table.spec(tenant)
        if spec.max_concurrent_requests and state is not None \
                and state.in_progress >= spec.max_concurrent_requests:
            return QuotaRefusal("concurrency", f"tenant {tenant!r} has {state.in_progress} requests in "
                                f"progress, its quota (max_concurrent_requests = "
                                f"{spec.max_concurrent_requests})")
        bucket = state.bucket if state is not None else None
        if spec.tokens_per_s > 0 and bucket is not None:
            wait = bucket.wait_s(now, tokens)
            if wait == math.inf:
                return _over_burst(tenant, tokens, spec)
            if wait > 0.0:
                return QuotaRefusal("tokens", f"tenant {tenant!r} is over its quota of "
                                    f"{spec.tokens_per_s:g} tokens/s (burst {spec.burst:.0f}): "
                                    f"{bucket.level(now):.0f} tokens left for a request of {tokens}", wait)
        elif spec.tokens_per_s > 0 and tokens > spec.burst:
            return _over_burst(tenant, tokens, spec)
        return None

    def admit(self, tenant: str, tokens: int, now: float) -> None:
        """A request of ``tokens`` tokens was admitted: charge the bucket, count it in progress."""
        state = self.state(tenant)
        if state.bucket is not None:
            state.bucket.take(now, tokens)
        if state.in_progress == 0:
            self._busy_weight += state.spec.weight
            self._num_busy += 1
        state.in_progress += 1
        state.requests += 1
        state.tokens += tokens
        if len(self._states) > MAX_TRACKED_TENANTS:
            self._forget_idle(now)

    def leave(self, tenant: str) -> None:
        """A request of ``tenant`` is done, dropped or cancelled (its last input left)."""
        state = self._states.get(tenant)
        if state is None or state.in_progress == 0:
            return
        state.in_progress -= 1
        if state.in_progress == 0:
            self._num_busy -= 1  # back to exactly 0 when nobody is busy: no float drift
            self._busy_weight = self._busy_weight - state.spec.weight if self._num_busy else 0.0

    def refused(self, tenant: str, reason: str, now: float = 0.0) -> None:
        self.state(tenant).rejected[reason] += 1
        if len(self._states) > MAX_TRACKED_TENANTS:
            self._forget_idle(now)

    def in_progress(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return state.in_progress if state is not None else 0

    def share(self, tenant: str, limit: int) -> float:
        """The tenant's weighted share of ``limit`` among the tenants with requests in progress (itself
        counted as one of them)."""
        w = self.weight(tenant)
        return weighted_share(limit, w, self._busy_weight + (0.0 if self.in_progress(tenant) else w))

    def _forget_idle(self, now: float) -> None:
        for name in [n for n, s in self._states.items() if n not in self.table and n != DEFAULT_TENANT
                     and s.is_idle(now)]:
            del self._states[name]


def weighted_share(limit: int, weight: float, busy_weight: float) -> float:
    """A tenant of ``weight``'s share of a concurrency ``limit`` among busy tenants weighing
    ``busy_weight`` in all (itself included)."""
    return limit * weight / busy_weight if busy_weight > 0 else float(limit)


def admits_over_limit(held: int, share: float, total: int, limit: int) -> bool:
    """The fair order's rule at a concurrency limit that is reached: a tenant holding less than its
    weighted share is still admitted, up to twice the limit in all, so a flood cannot lock the others
    out (the encoder's ``max_concurrent_requests``, the LLM engine's sequence bound)."""
    return held < share and total < 2 * limit


def merged_usage(parts: Iterable[Iterable[tuple[str, TenantState]]]) -> list[tuple[str, TenantState]]:
    """Several ledgers' tenants (an engine's and its fallback's), their counts summed per tenant (the
    spec and token bucket: the first's), by name."""
    out: dict[str, TenantState] = {}
    for part in parts:
        for name, st in part:
            have = out.get(name)
            if have is None:
                out[name] = TenantState(st.spec, st.bucket, st.in_progress, st.requests, st.tokens,
                                        Counter(st.rejected))
            else:
                have.in_progress += st.in_progress
                have.requests += st.requests
                have.tokens += st.tokens
                have.rejected.update(st.rejected)
    return sorted(out.items())
