"""Iteration-level (continuous) batching over a paged KV cache: ``schedule(now) -> StepPlan``, ``update``.

Each step packs, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``), one token for every decoding sequence plus prefill chunks of waiting or
partially prefilled ones (chunked prefill, as in vLLM v1: a sequence is simply "behind" by
``num_pending_tokens`` and the step lets it catch up by as many as the budget allows).

Order is a key: FCFS ``(arrival, seq_id)`` or priority ``(priority, arrival, seq_id)``. Under priority
a sequence that has waited ``max_priority_wait_s`` since its arrival is *aged*: it is ordered ahead of
every sequence that is not, and aged sequences among themselves by ``(arrival, seq_id)``, i.e. FCFS.
Nothing that arrives after an aged sequence can go ahead of it, so it is admitted within
``max_priority_wait_s`` plus the time to serve what arrived before it and what was already running when
it aged, whatever the later traffic. Running sequences are served in key order; when one needs a block
and none is free, the *worst* running sequence not yet served this step (last in key order — possibly
the one asking) is preempted. ``core/preemption.py`` picks how: *recompute* (its blocks are freed and it
returns to the waiting queue with its original key, so it resumes ahead of everything that arrived
after it) or *swap* (its blocks are copied to host blocks, ``core/swap_space.py``, and it goes to the
swapped queue keeping its computed tokens). The best running sequence can always evict all others and
alone it always fits (``add`` rejects any sequence whose worst case exceeds the pool), so every step
makes progress and nothing deadlocks or starves behind later arrivals. After the running sequences,
in a step that did not preempt: swapped sequences are swapped back in key order (head-of-line), then,
once none is left swapped, waiting sequences are admitted in key order with no overtaking. A swapped
sequence was running, so resuming it first adds no work the bounds above do not already count. The
plan lists the block copies (``swap_out`` before ``swap_in``, never both in one step) the driver makes
before the step's forward.

Time enters only as an argument: the driver (engine thread, simulator, test) calls ``expire(now)`` and
``schedule(now)`` on the clock its arrivals are stamped with, runs the plan, and hands the sampled
tokens to ``update``. Admission (which requests enter at all) is ``core/llm_admission.py``'s."""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping

from batchpilot.core.block_manager import BlockManager, BlockStats
from batchpilot.core.llm_admission import past_deadline
from batchpilot.core.llm_config import DECODE_RUN_TOKENS, LLMPolicy, LLMSchedulerConfig, PreemptionMode
from batchpilot.core.llm_fits import never_fits
from batchpilot.core.llm_plan import ScheduledChunk, SeqOutput, StepPlan, decode_groups
from batchpilot.core.preemption import PreemptionCosts, PreemptionCounters, choose
from batchpilot.core.sequence import FinishReason, SeqStatus, Sequence
from batchpilot.core.swap_space import SwapSpace

__all__ = ["DECODE_RUN_TOKENS", "LLMPolicy", "LLMScheduler", "LLMSchedulerConfig",
           "PreemptionCosts", "PreemptionMode", "ScheduledChunk", "SeqOutput", "StepPlan", "decode_groups"]


class LLMScheduler:
    """Owns the sequences, the block manager and the swap space; see the module docstring for the policy.

    ``preemption_costs`` prices swap against recompute for ``preemption="auto"`` (``core/preemption.py``;
    None: auto recomputes). A swapped sequence has status ``WAITING`` and sits in ``swapped``."""

    def __init__(self, config: LLMSchedulerConfig | None = None,
                 preemption_costs: PreemptionCosts | None = None) -> None:
        self.config = config or LLMSchedulerConfig()
        c = self.config
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
        """Why this sequence can never run to completion here (None if it can): ``core/llm_fits.py``."""
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
        self._finish(seq, reason)
        return True

    def expire(self, now: float) -> list[Sequence]:
        """Finish (``EXPIRED``) and free every sequence past its ``deadline`` at ``now``, wherever it is;
        returns them. Drivers call it before each step (``core/llm_admission.py``)."""
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

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take a running sequence's device blocks: swap it out or free them for recompute."""
        bm, count = self.block_manager, self.preemption
        self.running.remove(seq)
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        plan.preempted.append(seq.seq_id)
        blocks = bm.blocks_for(seq.num_computed_tokens)
        shared = any(bm.ref_count(b) > 1 for b in bm.block_table(seq.seq_id))
        how = choose(self.config.preemption, self.preemption_costs, blocks, seq.num_computed_tokens,
                     self.swap_space.num_free_blocks, shared)
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

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            target = seq.num_computed_tokens + n
            while not bm.can_allocate(seq.seq_id, target):
                victim = self.running[-1]  # key order: everything after i is worse than seq
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq preempted itself: it was the last running sequence not yet served
            bm.allocate(seq.seq_id, target)
            served.append((seq, n))
            budget -= n
            i += 1

        if not plan.preempted:
            budget = self._swap_in(plan, budget, served)
        if not plan.preempted and not self.swapped:
            while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
                seq = self.waiting[0]
                tokens = seq.all_token_ids
                cached = bm.num_cached_tokens(seq.seq_id, tokens)
                n = min(seq.num_tokens - cached, budget)
                if not c.enable_chunked_prefill and n < seq.num_tokens - cached and not seq.num_preemptions:
                    # a prompt waits for a step with room for all of it; a preempted sequence's
                    # recompute (prompt + tokens generated so far) may exceed the budget, which only
                    # chunks can serve: without them it would wait forever
                    break
                if not bm.can_allocate(seq.seq_id, cached + n, tokens):
                    break
                hit = bm.allocate(seq.seq_id, cached + n, tokens)
                seq.num_computed_tokens = hit
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = hit
                self.waiting.pop(0)
                seq.status = SeqStatus.RUNNING
                self._insert(self.running, seq)
                served.append((seq, n))
                budget -= n

        for seq, n in served:
            plan.chunks.append(ScheduledChunk.next_of(seq, n, bm.block_table(seq.seq_id)))
        return plan

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
            if (
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
