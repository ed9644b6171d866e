"""The LLM scheduler: iteration-level (continuous) batching over a paged KV cache,
``schedule(now) -> StepPlan`` and ``update``.

Each step packs, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``), one token for every decoding sequence plus prefill chunks of waiting or
partially prefilled ones (chunked prefill, as in vLLM v1: a sequence is simply "behind" by
``num_pending_tokens`` and the step lets it catch up by as many as the budget allows).

Order is a key: FCFS ``(arrival, seq_id)`` or priority ``(priority, arrival, seq_id)``. Under priority a
sequence that has waited ``max_priority_wait_s`` since its arrival is *aged*: it is ordered ahead of every
sequence that is not, and aged sequences among themselves by ``(arrival, seq_id)``, i.e. FCFS. Nothing
that arrives after an aged sequence can go ahead of it, so it is admitted within ``max_priority_wait_s``
plus the time to serve what arrived before it and what was already running when it aged, whatever the
later traffic. Running sequences are served in key order; when one needs a block and none is free, the
*worst* running sequence not yet served this step (last in key order — possibly the one asking) is
preempted. The preemption rule (below) picks how: *recompute* (its blocks are freed and it returns to the
waiting queue with its original key, so it resumes ahead of everything that arrived after it) or *swap*
(its blocks are copied to host blocks, ``core/llm/blocks.py``, and it goes to the swapped queue keeping
its computed tokens). The best running sequence can always evict all others and alone it always fits
(``add`` rejects any sequence whose worst case exceeds the pool), so every step makes progress and nothing
deadlocks or starves behind later arrivals. After the running sequences, in a step that did not preempt:
swapped sequences are swapped back in key order (head-of-line), then, once none is left swapped, waiting
sequences are admitted in key order with no overtaking. A swapped sequence was running, so resuming it
first adds no work the bounds above do not already count. The plan lists the block copies (``swap_out``
before ``swap_in``, never both in one step) the driver makes before the step's forward.

Time enters only as an argument: the driver (engine thread, simulator, test) calls ``expire(now)`` and
``schedule(now)`` on the clock its arrivals are stamped with, runs the plan, and hands the sampled
tokens to ``update``. Admission (which requests enter at all) is ``core/llm/admission.py``'s.

Sections, in order: one engine step's work as the scheduler plans it and the model runner executes it,
what a preempted sequence costs to bring back (and the swap-or-recompute rule), and the scheduler.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from batchpilot.core.costmodel import CostModel, StepShape
from batchpilot.core.llm.admission import never_fits, past_deadline
from batchpilot.core.llm.blocks import BlockManager, BlockStats, Source, SwapSpace
from batchpilot.core.llm.config import DECODE_RUN_TOKENS, LLMSchedulerConfig, PreemptionMode
from batchpilot.core.llm.fair import FairWaiting, TokenPrices
from batchpilot.core.llm.sequence import FinishReason, SeqStatus, Sequence

# -- One step's work -------------------------------------------------------------------------------
# One engine step's work, as the scheduler plans it and the model runner executes it.
#
#     ScheduledChunk   compute KV for some tokens of one sequence (a prefill chunk or one decode)
#     StepPlan         the chunks of one step, the sequences it preempted and the KV block copies of
#                      swapping (made before the forward); ``shape`` is what the cost model prices
#     SeqOutput        what one sequence produced in a step: a new token, and maybe its end
#     decode_groups    how the runner splits a step's decodes into runs padded to their own longest
#                      context (shared with the cost model's KV feature, so both agree on a step's reads)
#     (``core/llm/config.largest_gather`` is the most context tokens one gather can hold under a config)

@dataclass(frozen=True, slots=True)
class SeqOutput:
    """What one sequence produced in a step: a new token, and maybe its end."""

    seq_id: int
    token_id: int
    finish_reason: FinishReason | None


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute KV for ``token_ids`` at positions ``start .. start+len-1`` of one sequence."""

    seq_id: int
    start: int
    token_ids: list[int]
    block_table: list[int]
    sample: bool  # this chunk reaches the sequence's last token: sample the next one
    is_decode: bool  # a generated token (one per step), as opposed to prompt or recompute prefill

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)

    @classmethod
    def next_of(cls, seq: Sequence, n: int, block_table: list[int]) -> ScheduledChunk:
        """The sequence's next ``n`` tokens after its computed ones (samples if they reach its end)."""
        start = seq.num_computed_tokens
        return cls(seq.seq_id, start, seq.token_ids(start, start + n), block_table,
                   sample=start + n == seq.num_tokens, is_decode=start >= seq.num_prompt_tokens)


@dataclass(slots=True)
class StepPlan:
    """One step: the chunks to compute and, to make *before* the forward, the KV block copies of
    sequences swapped out (device -> host) or back in (host -> device) this step.

    ``swap_out`` pairs are ``(device_block, host_block)``, ``swap_in`` pairs ``(host_block, device_block)``;
    a step has one kind or the other, never both. A device block a swap-out frees may appear in this
    step's chunks (another sequence's new block), so the copies must come first. ``preempted`` lists
    every sequence preempted this step, ``swapped_out`` those of them whose KV went to host blocks (the
    rest recompute), ``swapped_in`` the sequences whose KV comes back (each has a chunk in this step).
    ``decode_run_tokens``: the bound of the runs its decodes are gathered in (``decode_groups``; the
    scheduler's ``config.decode_run_tokens``)."""

    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[int] = field(default_factory=list)
    swapped_in: list[int] = field(default_factory=list)
    decode_run_tokens: int = DECODE_RUN_TOKENS

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to copy."""
        return not self.chunks and not self.swap_out and not self.swap_in

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def shape(self) -> StepShape:
        """What the cost model needs: prefill tokens, decoding sequences, KV read, prefill attention.

        The KV read of the decodes is what the runner gathers: decodes sorted by context, split by
        ``decode_groups``, each group padded to its longest context. Three decodes at 120/250/380 in one group
        tokens read 3 x 380, not 750: they cost more than three at 250, which a sum of contexts
        cannot see."""
        prefill = [c for c in self.chunks if not c.is_decode]
        ctx = sorted(c.context_len for c in self.chunks if c.is_decode)
        groups = decode_groups(ctx, self.decode_run_tokens)
        padded = sum((b - a) * ctx[b - 1] for a, b in groups)
        return StepShape(
            prefill_tokens=sum(c.num_tokens for c in prefill),
            decode_seqs=len(ctx),
            kv_tokens=padded + sum(c.context_len for c in prefill),
            prefill_attn=sum(c.num_tokens * c.context_len for c in prefill),
        )


def decode_groups(ctx_sorted: Seq[int], max_tokens: int = DECODE_RUN_TOKENS) -> list[tuple[int, int]]:
    """How a runner splits decodes sorted by context (ascending) into ``[start, end)`` runs, each
    gathered and attended as one batch padded to its own longest context: from the shortest on, a run
    takes the next decode while its padded keys (members x the longest context) stay within
    ``max_tokens``; a decode longer than that runs alone. Shared with the cost model's KV features, so
    the two agree on what a step reads.

    Why a bound in tokens: a run's gathered keys and values are one buffer, and past a few MiB it leaves
    the CPU's caches. On an AMD EPYC (tiny Llama, fp32: 2 KiB of K and V per token and layer) 12 decodes
    at context 700 took 34.94 ms as one run, 27.67 ms in runs of at most 2,048 keys; at context 256
    the split saved nothing (docs/llm.md, "Decode runs"). Runs within a few MiB also cost about the same per
    token at any context, so the step model prices them with a line."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ctx_sorted)):
        if (i + 1 - start) * ctx_sorted[i] > max_tokens:
            groups.append((start, i))
            start = i
    if ctx_sorted:
        groups.append((start, len(ctx_sorted)))
    return groups


# -- Preemption costs ------------------------------------------------------------------------------
# What a preempted sequence costs to bring back, and the rule that picks swap or recompute for it.
#
# When the scheduler must take a running sequence's KV blocks, the sequence can come back two ways:
#
# * **recompute**: its blocks are freed and, when it is admitted again, its ``num_computed_tokens``
#   (prompt + outputs so far) are prefilled again;
# * **swap**: its blocks are copied to host memory (``core/llm/blocks.py``), freed, and copied back into
#   fresh device blocks before it runs again; nothing is computed twice.
#
# ``PreemptionCosts`` prices both in seconds, from measured figures (never a machine's constants):
#
#     swap       num_blocks * (swap_out_s_per_block + swap_in_s_per_block)
#     recompute  prefill_s_per_token * T + prefill_s_per_attn * T * T      (T = num_computed_tokens)
#
# The recompute price is the marginal cost the step cost model (``core/costmodel.py``, ``LLM_FEATURES``)
# gives a prefill chunk of ``T`` tokens from position 0: ``T`` prefill tokens, ``T`` KV tokens read and
# ``T * T`` units of prefill attention (a recompute split into chunks reads no more than that). The
# step's fixed cost is left out: a recompute shares a step with other work.
#
# ``choose(mode, costs, ...)`` is the whole decision:
#
# * ``recompute``: never swap;
# * ``swap``: swap whenever the host has room for the sequence's blocks;
# * ``auto``: swap when the host has room and the swap round trip is cheaper than the recompute; without
#   costs (``None``) or without swap space, recompute.
#
# In every mode a sequence with no computed tokens is recomputed (nothing to copy), and so is one holding
# a block shared with another sequence (prefix caching, reference count > 1): freeing a shared block gives
# no memory back, and the shared prefix stays on the device, keyed in the prefix cache, so its recompute
# is served from the cache for that prefix instead of computed again.

Preemption = Literal["swap", "recompute"]

SWAP_META_KEYS = ("swap_out_s_per_block", "swap_in_s_per_block")


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """Seconds to bring a preempted sequence back, each way (see the module docstring for the rule)."""

    swap_out_s_per_block: float  # copy one KV block (K and V, every layer) device -> host
    swap_in_s_per_block: float  # host -> device
    prefill_s_per_token: float  # one recomputed token: its prefill row plus the KV token it reads
    prefill_s_per_attn: float = 0.0  # one unit of prefill attention (a query token x a context token)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:
                raise ValueError(f"preemption costs: {name} must be >= 0 seconds, got {value}")

    def swap_s(self, num_out_blocks: int, num_in_blocks: int) -> float:
        """Seconds the block copies of one step take (what a simulated step adds to its forward)."""
        return num_out_blocks * self.swap_out_s_per_block + num_in_blocks * self.swap_in_s_per_block

    def round_trip_s(self, num_blocks: int) -> float:
        """Seconds to swap ``num_blocks`` blocks out and back in."""
        return self.swap_s(num_blocks, num_blocks)

    def recompute_s(self, num_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` again from position 0 (the step's fixed cost left out)."""
        return self.prefill_s_per_token * num_tokens + self.prefill_s_per_attn * num_tokens * num_tokens

    def to_meta(self) -> dict[str, float]:
        """The swap figures as a profile's ``meta`` entries (``SWAP_META_KEYS``)."""
        return {"swap_out_s_per_block": self.swap_out_s_per_block,
                "swap_in_s_per_block": self.swap_in_s_per_block}

    @classmethod
    def from_cost_model(cls, cost_model: CostModel, swap_out_s_per_block: float | None = None,
                        swap_in_s_per_block: float | None = None) -> PreemptionCosts:
        """The recompute price from an LLM step model's coefficients (``prefill_tokens`` + ``kv_tokens``
        per token, ``prefill_attn`` per unit); the swap figures as given, else from the model's ``meta``
        (``SWAP_META_KEYS``, what ``profile_llm_steps`` records when its runner has swap space).
        Raises ``ValueError`` when a swap figure is neither given nor in the profile."""
        coef = dict(zip(cost_model.feature_names, cost_model.latency_coef, strict=True))
        meta: Mapping[str, Any] = cost_model.meta
        out = swap_out_s_per_block if swap_out_s_per_block is not None else meta.get(SWAP_META_KEYS[0])
        back = swap_in_s_per_block if swap_in_s_per_block is not None else meta.get(SWAP_META_KEYS[1])
        if out is None or back is None:
            raise ValueError(f"preemption costs: the cost model ({meta.get('source', 'no source')}) records "
                             f"no {' / '.join(SWAP_META_KEYS)}; profile a runner with swap blocks or give "
                             f"them")
        per_token = coef.get("prefill_tokens", 0.0) + coef.get("kv_tokens", 0.0)
        return cls(float(out), float(back), per_token, coef.get("prefill_attn", 0.0))


def choose(mode: PreemptionMode, costs: PreemptionCosts | None, num_blocks: int, num_computed_tokens: int,
           num_free_host_blocks: int, shares_blocks: bool = False) -> Preemption:
    """Swap or recompute for one preempted sequence holding ``num_blocks`` blocks of computed KV
    (``num_computed_tokens`` tokens); ``shares_blocks``: one of its blocks has a reference count > 1."""
    if mode == "recompute" or shares_blocks or num_blocks == 0 or num_computed_tokens == 0:
        return "recompute"
    if num_blocks > num_free_host_blocks:
        return "recompute"
    if mode == "swap":
        return "swap"
    if costs is None:
        return "recompute"
    return "swap" if costs.round_trip_s(num_blocks) < costs.recompute_s(num_computed_tokens) else "recompute"


@dataclass(slots=True)
class PreemptionCounters:
    """What preemption has done so far: the scheduler's running totals (its ``num_preemptions`` is
    ``num_swapped_out + num_recompute_preemptions``)."""

    num_swapped_out: int = 0  # sequences whose KV was copied to host blocks
    num_swapped_in: int = 0  # sequences whose KV was copied back to device blocks
    num_recompute_preemptions: int = 0  # sequences whose blocks were freed, to be prefilled again
    num_recomputed_tokens: int = 0  # computed tokens those recomputes threw away (before prefix-cache hits)
    num_blocks_swapped_out: int = 0  # blocks copied device -> host
    num_blocks_swapped_in: int = 0  # blocks copied host -> device

    def swapped_out(self, num_blocks: int) -> None:
        self.num_swapped_out += 1
        self.num_blocks_swapped_out += num_blocks

    def swapped_in(self, num_blocks: int) -> None:
        self.num_swapped_in += 1
        self.num_blocks_swapped_in += num_blocks

    def recomputed(self, num_tokens: int) -> None:
        self.num_recompute_preemptions += 1
        self.num_recomputed_tokens += num_tokens


# -- The scheduler ---------------------------------------------------------------------------------

class LLMScheduler:
    """Owns the sequences, the block manager and the swap space; see the module docstring for the policy.

    ``preemption_costs`` prices swap against recompute for ``preemption="auto"`` (the section above;
    None: auto recomputes). A swapped sequence has status ``WAITING`` and sits in ``swapped``."""

    def __init__(self, config: LLMSchedulerConfig | None = None,
                 preemption_costs: PreemptionCosts | None = None, prices: TokenPrices | None = None,
                 weight_of: Callable[[str], float] | None = None) -> None:
        """``prices`` and ``weight_of``: what a chunk costs its tenant and each tenant's weight under
        ``policy: fair`` (``core/llm/fair.py``; defaults: VTC's token weights, every weight 1)."""
        self.config = config or LLMSchedulerConfig()
        c = self.config
        self.fair = FairWaiting(prices, weight_of, c.fair_burst_tokens) if c.policy == "fair" else None
        self.block_manager = BlockManager(c.num_kv_blocks, c.block_size, c.enable_prefix_caching)
        self.swap_space = SwapSpace(c.num_swap_blocks)
        self.preemption_costs = preemption_costs
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # sorted by _key
        self.swapped: list[Sequence] = []  # sorted by _key
        self.seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0  # swapped out + recomputed (see ``preemption`` for each)
        self.preemption = PreemptionCounters()
        self.num_rejected = 0
        self._step_id = 0
        self._aged_upto = -math.inf  # under priority, a sequence that arrived at or before this is aged

    # -- ordering ----------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[float, ...]:
        if self.config.policy == "priority":
            if seq.arrival <= self._aged_upto:
                return (0, 0, seq.arrival, seq.seq_id)  # waited max_priority_wait_s: FCFS, ahead of the rest
            return (1, seq.priority, seq.arrival, seq.seq_id)
        return (seq.arrival, seq.seq_id)

    def _age(self, now: float) -> None:
        """Move the aging line to ``now - max_priority_wait_s``; re-sort a queue a sequence crossed it in."""
        wait = self.config.max_priority_wait_s
        if self.config.policy != "priority" or wait <= 0 or now - wait <= self._aged_upto:
            return
        before, self._aged_upto = self._aged_upto, now - wait
        for queue in (self.waiting, self.running, self.swapped):
            if any(before < q.arrival <= self._aged_upto for q in queue):
                queue.sort(key=self._key)

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key)
        if self.fair is not None and queue is self.waiting:
            self.fair.entered(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def block_stats(self) -> BlockStats:
        return self.block_manager.stats()

    # -- requests in and out -----------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> str | None:
        """Why this sequence can never run to completion here (None if it can): ``core/llm/admission.py``."""
        return never_fits(self.config, seq)

    def add(self, seq: Sequence) -> str | None:
        """Queue a sequence; return a reason (and finish it as REJECTED) if it can never fit."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already in the scheduler")
        reason = self.check_fits(seq)
        if reason is not None:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.REJECTED
            seq.reject_reason = reason
            self.num_rejected += 1
            return reason
        seq.status = SeqStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self._insert(self.waiting, seq)
        return None

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Cancel a sequence wherever it is and free its blocks (device or host). False if unknown or
        finished."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        swapped = self.swap_space.has(seq_id)
        queue = self.running if seq.status is SeqStatus.RUNNING else self.swapped if swapped else self.waiting
        queue.remove(seq)
        if self.fair is not None and queue is self.waiting:
            self.fair.left(seq)
        self._finish(seq, reason)
        return True

    def expire(self, now: float) -> list[Sequence]:
        """Finish (``EXPIRED``) and free every sequence past its ``deadline`` at ``now``, wherever it is;
        returns them. Drivers call it before each step (``core/llm/admission.py``)."""
        late = [seq for seq in self.seqs.values() if past_deadline(seq, now)]
        for seq in late:
            self.abort(seq.seq_id, FinishReason.EXPIRED)
        return late

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq.seq_id)
        self.swap_space.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]

    def _preempt(self, seq: Sequence, plan: StepPlan, recompute: bool = False) -> None:
        """Take a running sequence's device blocks: swap it out or free them for recompute (always, with
        ``recompute``)."""
        bm, count = self.block_manager, self.preemption
        self.running.remove(seq)
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        plan.preempted.append(seq.seq_id)
        blocks = bm.blocks_for(seq.num_computed_tokens)
        shared = any(bm.ref_count(b) > 1 for b in bm.block_table(seq.seq_id))
        how = "recompute" if recompute else choose(self.config.preemption, self.preemption_costs, blocks,
                                                    seq.num_computed_tokens, self.swap_space.num_free_blocks,
                                                    shared)
        if how == "swap":
            plan.swap_out += self.swap_space.swap_out(bm, seq.seq_id, blocks)
            plan.swapped_out.append(seq.seq_id)
            count.swapped_out(blocks)
            self._insert(self.swapped, seq)
            return
        bm.free(seq.seq_id)
        count.recomputed(seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        self._insert(self.waiting, seq)

    def _preempt_group_tail(self, victim: Sequence, served: Sequence, plan: StepPlan) -> None:
        """A preempted sample's running group-mates at the tail of the key order (not yet served this
        step) go with it: a group is brought back together, sharing its prompt's blocks again."""
        while (victim.group is not None and self.running and self.running[-1] is not served
               and self.running[-1].group == victim.group):
            self._preempt(self.running[-1], plan)

    def _group_source(self, seq: Sequence) -> tuple[bool, Source | None]:
        """(wait, source): where a waiting sample of an ``n > 1`` group takes its prompt's blocks from.
        Its group's first sequence once that has computed the prompt: ``(False, (seq_id, prompt
        tokens))``; ``(True, None)`` while the first is still computing it (or waits to); ``(False,
        None)`` for a sequence outside a group, the first itself, or one whose first has finished (the
        prefix cache may still serve it)."""
        if seq.group is None or seq.group == seq.seq_id:
            return False, None
        first = self.seqs.get(seq.group)
        if first is None:
            return False, None
        if first.status is not SeqStatus.RUNNING or first.num_computed_tokens < first.num_prompt_tokens:
            return True, None
        return False, (first.seq_id, first.num_prompt_tokens)

    def _fair_room(self, plan: StepPlan) -> int:
        """Under ``policy: fair``: for each waiting sequence in fair order while the step's budget lasts,
        preempt running sequences while it finds no room and ``FairWaiting.victim`` names one
        (``core/llm/fair.py``); returns how many were preempted."""
        fair, c, bm = self.fair, self.config, self.block_manager
        assert fair is not None
        made = admitted = blocks = 0  # preempted; and the sequences and blocks room was made for
        budget = c.max_num_batched_tokens - len(self.running)
        for seq in fair.order(self.waiting):
            if budget <= 0 or self._group_source(seq)[0]:
                break
            first = min(seq.num_tokens, budget)
            need = blocks + bm.blocks_for(first)
            while len(self.running) + admitted >= c.max_num_seqs or bm.num_free_blocks < need:
                victim = fair.victim(seq, self.running)
                if victim is None:
                    return made
                self._preempt(victim, plan, recompute=True)  # back to waiting, where fair order places it
                made += 1
                budget += 1
            admitted, blocks, budget = admitted + 1, need, budget - first
        return made

    def _swap_in(self, plan: StepPlan, budget: int, served: list[tuple[Sequence, int]]) -> int:
        """Swapped sequences back to the device in key order (head-of-line), each with a chunk in this
        step; returns the token budget left."""
        bm, count = self.block_manager, self.preemption
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_pending_tokens, budget)
            if not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                break
            pairs = self.swap_space.swap_in(bm, seq.seq_id, seq.num_computed_tokens + n)
            plan.swap_in += pairs
            plan.swapped_in.append(seq.seq_id)
            count.swapped_in(len(pairs))
            self.swapped.pop(0)
            seq.status = SeqStatus.RUNNING
            self._insert(self.running, seq)
            served.append((seq, n))
            budget -= n
        return budget

    # -- the two calls -----------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> StepPlan:
        """Choose this step's work at ``now`` (the clock of ``Sequence.arrival``; None: no time has
        passed since the last call, so nothing ages). Mutates block tables and queues; the plan is
        plain data."""
        if now is not None:
            self._age(now)
        c = self.config
        bm = self.block_manager
        plan = StepPlan(step_id=self._step_id, decode_run_tokens=self.config.decode_run_tokens)
        self._step_id += 1
        budget = c.max_num_batched_tokens
        served: list[tuple[Sequence, int]] = []
        fair = self.fair
        made_room = self._fair_room(plan) if fair is not None and self.waiting else 0
        shares = fair.prefill_shares(self.running, self.waiting, budget) if fair is not None else None

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            if shares is not None and n > 1:
                n = min(n, shares.get(seq.seq_id, 0))
                if n == 0:  # its tenant's turn for prefill tokens comes after this step's budget
                    i += 1
                    continue
            target = seq.num_computed_tokens + n
            while not bm.can_allocate(seq.seq_id, target):
                # key order: everything after i is worse than seq; under fair, the latest of the tenant
                # ordered last among those not yet served (seq included)
                victim = self.running[-1] if fair is None else fair.last(self.running, i)
                self._preempt(victim, plan)
                if victim is seq:
                    break
                self._preempt_group_tail(victim, seq, plan)
            if seq.status is not SeqStatus.RUNNING:
                if fair is not None:
                    continue  # running[i] is now the next one
                break  # seq preempted itself: it was the last running sequence not yet served
            bm.allocate(seq.seq_id, target)
            served.append((seq, n))
            budget -= n
            i += 1

        if not plan.preempted:
            budget = self._swap_in(plan, budget, served)
        if fair is not None:  # what the running sequences get this step, before anyone is admitted
            for seq, n in served:
                fair.charge(seq, n)
        # a step admits only when it preempted nothing and nothing waits swapped, or when it preempted
        # only to make room for whom fair order admits next
        if (not plan.preempted and not self.swapped) or (made_room and len(plan.preempted) == made_room):
            self._admit(plan, budget, served, made_room > 0)

        for seq, n in served:
            plan.chunks.append(ScheduledChunk.next_of(seq, n, bm.block_table(seq.seq_id)))
        return plan

    def _admit(self, plan: StepPlan, budget: int, served: list[tuple[Sequence, int]],
               made_room: bool) -> None:
        """Waiting sequences into the running batch, in key order (or fair order), each with its first
        chunk, while the budget, the sequence cap and the blocks allow; no overtaking."""
        c, bm, fair = self.config, self.block_manager, self.fair
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            pick = fair.pick(self.waiting) if fair is not None else 0
            seq = self.waiting[pick]
            if made_room and seq.seq_id in plan.preempted:
                break  # preempted in this step to make room: not back in it
            wait, source = self._group_source(seq)
            if wait:
                break  # its group's first sequence is still computing the prompt they share
            tokens = seq.all_token_ids
            cached = bm.num_cached_tokens(seq.seq_id, tokens, source)
            n = min(seq.num_tokens - cached, budget)
            if not c.enable_chunked_prefill and n < seq.num_tokens - cached and not seq.num_preemptions:
                # a prompt waits for a step with room for all of it; a preempted sequence's
                # recompute (prompt + tokens generated so far) may exceed the budget, which only
                # chunks can serve: without them it would wait forever
                break
            if not bm.can_allocate(seq.seq_id, cached + n, tokens, source):
                break
            hit = bm.allocate(seq.seq_id, cached + n, tokens, source)
            seq.num_computed_tokens = hit
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit
            self.waiting.pop(pick)
            if fair is not None:
                fair.left(seq)
                fair.charge(seq, n)
            seq.status = SeqStatus.RUNNING
            self._insert(self.running, seq)
            served.append((seq, n))
            budget -= n

    def update(
        self, plan: StepPlan, sampled: Mapping[int, int], stopped: Collection[int] = ()
    ) -> list[SeqOutput]:
        """Apply a step's results: advance computed counts, append sampled tokens, finish sequences.

        ``sampled`` maps seq_id -> the new token of every chunk with ``sample``; ``stopped`` names
        sequences the driver ended on a stop string (matched on text, which core cannot see).
        """
        c = self.config
        outputs: list[SeqOutput] = []
        for chunk in plan.chunks:
            seq = self.seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING or seq.num_computed_tokens != chunk.start:
                continue  # aborted or preempted since the plan was made
            seq.num_computed_tokens += chunk.num_tokens
            if self.block_manager.enable_prefix_caching:
                self.block_manager.on_computed(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            if not chunk.sample:
                continue
            token = int(sampled[seq.seq_id])
            seq.output_token_ids.append(token)
            reason: FinishReason | None = None
            p = seq.params
            if seq.num_output_tokens > p.min_tokens and (
                seq.seq_id in stopped
                or (not p.ignore_eos and token in c.eos_token_ids)
                or token in p.stop_token_ids
            ):
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= c.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            outputs.append(SeqOutput(seq.seq_id, token, reason))
        return outputs
