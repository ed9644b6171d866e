"""Admission and deadlines of LLM requests: which requests an engine takes, and when it gives one up.

An engine holds at most ``max_num_seqs + max_waiting_seqs`` sequences admitted and not yet done
(running, waiting, swapped, or on their way to the scheduler). ``LLMAdmission.admit(seqs)`` takes the
sequences of one request (one per prompt) together or none of them, and a refusal says why:

* ``context_length_exceeded``: one of them can never run to completion here (``core/llm/scheduler.py``:
  prompt + ``max_tokens`` past ``max_model_len``, more KV blocks than the pool, a prompt over the step
  budget with chunked prefill off); the server's 400, nothing to retry;
* ``quota_tokens`` / ``quota_concurrency``: the tenant's quotas (``core/tenants.py``, the keys file's;
  ``set_tenants``): its token bucket, charged a request's prompt tokens plus the tokens it may generate
  (``max_tokens``) of every sequence, or its requests in progress; the server's 429 with ``Retry-After``;
* ``queue_full``: admitting them would pass the bound; the server's 503 with ``Retry-After``.

A refusal changes nothing but the refusal counts (``refused``, and the tenant's in ``tenants``); an
admission counts the sequences until ``release(seq_id)`` (once per sequence, when it is done:
finished, aborted, expired or failed) and the request in its tenant's usage until its last sequence is
released. ``room(n, tenant, now)`` is the quotas and the bound; ``ask(n, tenant, now)`` is that check
made for a request before it is tokenised (its tokens counted as one each), its refusal counted.
Under ``policy: fair`` the bound is shared by weight as the encoder's concurrency limit is
(``core/tenants.admits_over_limit``): at the bound, a tenant holding fewer sequences than its weighted
share is still admitted, up to twice the bound in all, so a flood cannot lock the others out.

Deadlines: ``request_deadline(config, received, requested_s)`` is a request's deadline, ``received +
min(request_timeout_s, requested_s)`` on the clock ``received`` is read from; each of its sequences
carries it (``Sequence.deadline``), and ``past_deadline(seq, now)`` is the one test of it.
``LLMScheduler.expire(now)`` finishes and frees every sequence past it (the server's 504), and the
static fallback drops its requests by the same test.

The live engine admits on the caller's thread under its lock (the engine thread owns the scheduler,
not this count), the simulator at each arrival, the fallback as the engine does. Pure: no clock.

Whether a sequence can ever fit (``never_fits``) is the file's last section.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.sequence import Sequence
from batchpilot.core.request import DEFAULT_TENANT
from batchpilot.core.tenants import TenantLedger, TenantState, TenantTable, admits_over_limit, weighted_share

NEVER_FITS = "context_length_exceeded"
QUEUE_FULL = "queue_full"
QUOTA_TOKENS = "quota_tokens"  # the reasons' values are the encoder's (core/admission.RejectReason)
QUOTA_CONCURRENCY = "quota_concurrency"
TIMEOUT = "timeout"  # what a sequence that expired is counted as (the server's 504 code)
QUEUE_FULL_RETRY_AFTER_S = 1.0  # Retry-After of a full engine: about a step of decodes frees room


@dataclass(frozen=True, slots=True)
class LLMRefusal:
    """Why a request was not admitted: ``reason`` (``NEVER_FITS``, a quota's, ``QUEUE_FULL``), a message
    with the numbers and what to change, and when to retry (None: retrying cannot help)."""

    reason: str
    message: str
    retry_after_s: float | None = None


class LLMAdmission:
    """The count of sequences an engine has admitted and not yet released, against its bound."""

    def __init__(self, config: LLMSchedulerConfig, weight_of: Callable[[str], float] | None = None) -> None:
        """``weight_of``: each tenant's weight under ``policy: fair`` (default: all 1)."""
        self.config = config
        self.capacity = config.max_num_seqs + config.max_waiting_seqs
        self.num_admitted = 0
        self.refused: collections.Counter[str] = collections.Counter()  # requests refused, by reason
        self.fair = config.policy == "fair"
        self.weight_of = weight_of or (lambda _: 1.0)
        self.held: collections.Counter[str] = collections.Counter()  # tenant -> sequences admitted
        self.tenants = TenantLedger()  # quotas (set_tenants) and usage, per tenant
        self._request: dict[int, tuple[str, int]] = {}  # seq id -> (tenant, its request's first seq id)
        self._left: dict[int, int] = {}  # a request's first seq id -> its sequences not yet released

    def set_tenants(self, table: TenantTable, now: float) -> None:
        """The tenants' quotas (a keys file, reloaded or not), applied from now on."""
        self.tenants.set_table(table, now)

    def usage(self) -> list[tuple[str, TenantState]]:
        """Every tenant the admission tracks, by name: copies, to read on another thread."""
        return [(name, dataclasses.replace(st)) for name, st in self.tenants]

    def room(self, n: int = 1, tenant: str = DEFAULT_TENANT, now: float = 0.0,
             tokens: int | None = None) -> LLMRefusal | None:
        """A refusal if ``n`` more sequences of ``tenant``, ``tokens`` tokens in all (prompts plus
        ``max_tokens``; default ``n``), are over its quotas or would pass the bound at ``now``, else
        None. Changes nothing."""
        if n < 1:
            raise ValueError(f"LLM admission: a request has at least one sequence, got {n}")
        quota = self.tenants.check(tenant, n if tokens is None else tokens, now)
        if quota is not None:
            if quota.quota == "tokens":
                return LLMRefusal(QUOTA_TOKENS, quota.message, quota.retry_after_s)
            return LLMRefusal(QUOTA_CONCURRENCY, quota.message, QUEUE_FULL_RETRY_AFTER_S)
        total = self.num_admitted
        if total + n <= self.capacity:
            return None
        why = ""
        if self.fair:
            held = self.held[tenant]
            weight = self.weight_of
            busy = sum(weight(t) for t, k in self.held.items() if k and t != tenant) + weight(tenant)
            share = weighted_share(self.capacity, weight(tenant), busy)
            if admits_over_limit(held + n - 1, share, total + n - 1, self.capacity):
                return None
            why = f"; tenant {tenant!r} holds {held}, its weighted share is {share:.1f}"
        c = self.config
        return LLMRefusal(QUEUE_FULL, f"{total} sequences admitted of at most {self.capacity} "
                                      f"(max_num_seqs {c.max_num_seqs} + max_waiting_seqs "
                                      f"{c.max_waiting_seqs}){why}; {n} more do not fit: retry later, or "
                                      f"raise max_waiting_seqs", QUEUE_FULL_RETRY_AFTER_S)

    def ask(self, n: int = 1, tenant: str = DEFAULT_TENANT, now: float = 0.0) -> LLMRefusal | None:
        """``room(n, tenant, now)`` asked for a request before its sequences exist (a server asks before
        it spends time tokenising): a refusal is that request's answer, so it counts as one by ``admit``
        would."""
        refusal = self.room(n, tenant, now)
        if refusal is not None:
            self._count_refusal(refusal, tenant, now)
        return refusal

    def check(self, seqs: Iterable[Sequence], now: float = 0.0) -> LLMRefusal | None:
        """Why this request would be refused at ``now`` (None: it would be admitted). Changes nothing."""
        group = list(seqs)
        if not group:
            raise ValueError("LLM admission: a request has at least one sequence (one per prompt); "
                             "pass all of them together")
        for seq in group:
            reason = never_fits(self.config, seq)
            if reason is not None:
                return LLMRefusal(NEVER_FITS, reason)
        return self.room(len(group), group[0].tenant, now, _tokens(group))

    def admit(self, seqs: Iterable[Sequence], now: float = 0.0) -> LLMRefusal | None:
        """Admit every sequence of one request at ``now``, or none: None when admitted (each counts until
        ``release``), else the refusal (see the module docstring for the reasons, in the order checked)."""
        group = list(seqs)
        refusal = self.check(group, now)
        tenant = group[0].tenant
        if refusal is not None:
            self._count_refusal(refusal, tenant, now)
            return refusal
        self.num_admitted += len(group)
        self.held[tenant] += len(group)
        self.tenants.admit(tenant, _tokens(group), now)
        first = group[0].seq_id
        self._left[first] = len(group)
        for seq in group:
            self._request[seq.seq_id] = (tenant, first)
        return None

    def release(self, seq_id: int) -> None:
        """An admitted sequence is done (each released once); its request's last one ends the request in
        its tenant's usage."""
        entry = self._request.pop(seq_id, None)
        if entry is None:
            raise ValueError(f"LLM admission: release({seq_id}) of a sequence not admitted or already "
                             f"released; release each admitted sequence exactly once, when it is done")
        tenant, first = entry
        self.num_admitted -= 1
        left = self.held[tenant] - 1
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]
        if self._left[first] > 1:
            self._left[first] -= 1
        else:
            del self._left[first]
            self.tenants.leave(tenant)

    def _count_refusal(self, refusal: LLMRefusal, tenant: str, now: float) -> None:
        self.refused[refusal.reason] += 1
        self.tenants.refused(tenant, refusal.reason, now)


def _tokens(group: list[Sequence]) -> int:
    """What a request's sequences may cost its tenant's token quota: prompts plus ``max_tokens``."""
    return sum(seq.num_prompt_tokens + seq.params.max_tokens for seq in group)


def request_deadline(config: LLMSchedulerConfig, received: float, requested_s: float | None = None) -> float:
    """A request's deadline: ``received + request_timeout_s``, or sooner when the request asks for less
    (``requested_s``, e.g. its ``deadline_ms``); on the clock ``received`` is read from. A budget of 0 (a
    positive ``deadline_ms`` too small for a float second, say) is due at once: the request expires
    before its first step, as any other past its deadline."""
    if requested_s is not None and not requested_s >= 0:
        raise ValueError(f"LLM deadline: a requested budget must be >= 0 seconds, got {requested_s}")
    budget = config.request_timeout_s
    return received + (budget if requested_s is None else min(budget, requested_s))


def past_deadline(seq: Sequence, now: float) -> bool:
    """The sequence's deadline has come at ``now`` (never, without one)."""
    return seq.deadline is not None and seq.deadline <= now


# -- Whether a sequence can ever fit ---------------------------------------------------------------
# Whether a sequence can ever run to completion within an engine's limits: ``never_fits(config, seq)``.
#
# A sequence is refused at admission, with a reason a client can act on, when its worst case (prompt +
# ``max_tokens``) passes the model's context length or needs more KV blocks than the whole pool, or when
# its prompt exceeds the step's token budget with chunked prefill off. Everything else fits: alone on
# the engine it always runs to the end, which is what lets the scheduler promise progress.

def never_fits(c: LLMSchedulerConfig, seq: Sequence) -> str | None:
    """Why ``seq`` can never run to completion under ``c`` (None if it can). Pure and config-only."""
    worst = seq.num_prompt_tokens + seq.params.max_tokens
    if worst > c.max_model_len:
        return (
            f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {worst} "
            f"exceeds the model's context length of {c.max_model_len} tokens; shorten the prompt or "
            f"lower max_tokens"
        )
    blocks = -(-seq.max_total_tokens // c.block_size)
    if blocks > c.num_kv_blocks:
        return (
            f"prompt + max_tokens needs {blocks} KV blocks of {c.block_size} tokens but the pool has "
            f"only {c.num_kv_blocks}; lower max_tokens or raise num_kv_blocks"
        )
    if not c.enable_chunked_prefill and seq.num_prompt_tokens > c.max_num_batched_tokens:
        return (
            f"prompt ({seq.num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
            f"({c.max_num_batched_tokens}) with chunked prefill off; enable it or raise the budget"
        )
    return None


