"""One engine step's work, as the LLM scheduler plans it and the model runner executes it.

    ScheduledChunk   compute KV for some tokens of one sequence (a prefill chunk or one decode)
    StepPlan         the chunks of one step, the sequences it preempted and the KV block copies of
                     swapping (made before the forward); ``shape`` is what the cost model prices
    SeqOutput        what one sequence produced in a step: a new token, and maybe its end
    decode_groups    how the runner splits a step's decodes into runs padded to their own longest
                     context (shared with the cost model's KV feature, so both agree on a step's reads)
    largest_gather   the most context tokens one gather of a step can hold under a config (what the
                     memory plan reserves for it, and the runner's gather buffers never outgrow)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from batchpilot.core.costmodel import StepShape
from batchpilot.core.llm_config import DECODE_RUN_TOKENS, LLMSchedulerConfig
from batchpilot.core.sequence import FinishReason, Sequence


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


def largest_gather(config: LLMSchedulerConfig) -> int:
    """The most context tokens one gather of a step can hold under ``config``, in whole blocks (the
    runner gathers whole blocks): one sequence's context (a late prefill chunk, or a decode that runs
    alone) up to ``max_model_len``; or a run of ``m >= 2`` decodes (``decode_groups``), whose longest
    context ``L`` keeps ``m * L <= decode_run_tokens`` and ``L <= max_model_len``, gathered as ``m``
    times ``L`` rounded up to blocks. The gathers of a step run one after another into the same
    buffers, so the largest is the peak. Never more than ``max_num_seqs`` sequences of
    ``max_model_len``, the bound without runs."""
    bs = int(config.block_size)
    longest = int(config.max_model_len)

    def blocks(tokens: int) -> int:
        return -(-tokens // bs) * bs

    peak = blocks(longest)
    for m in range(2, int(config.max_num_seqs) + 1):
        ctx = min(int(config.decode_run_tokens) // m, longest)
        if ctx < 1:
            break
        peak = max(peak, m * blocks(ctx))
    return peak
