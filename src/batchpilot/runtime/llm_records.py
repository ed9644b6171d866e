"""What the LLM engine hands out: streamed outputs, token and step events for observers, and its stats."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchpilot.core.llm_scheduler import LLMScheduler
    from batchpilot.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """One streamed increment. ``text`` is the new text only; the last one has ``finish_reason``."""

    seq_id: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    # engine clock (time.monotonic): when the sequence reached the engine, and when this token left its
    # step; the server's Server-Timing header splits the first token's time with them
    arrival: float = 0.0
    emitted: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """For metrics observers: a token came out at ``t`` (engine clock, ``time.monotonic``)."""

    seq_id: int
    t: float
    ttft_s: float | None  # set on the first token
    itl_s: float | None  # set on later tokens
    finished: bool


def token_records(seq: Sequence, token_id: int, finish_reason: str | None, text: str, now: float,
                  last_t: float | None) -> tuple[GenerationOutput, TokenEvent]:
    """One token of ``seq`` leaving its step at ``now``: the stream's increment and the observers' event
    (TTFT when ``last_t``, the previous token's time, is None; else the gap since it)."""
    output = GenerationOutput(seq.seq_id, text, [token_id], finish_reason, seq.num_prompt_tokens,
                              seq.num_output_tokens, seq.num_cached_tokens, seq.arrival, now)
    first = last_t is None
    event = TokenEvent(seq.seq_id, now, now - seq.arrival if first else None,
                       None if first else now - (last_t or now), finish_reason is not None)
    return output, event


@dataclass(frozen=True, slots=True)
class StepRecord:
    """For step observers (``serve --llm-step-log``): one engine step, as the step cost model sees it.

    ``start`` is ``time.perf_counter()`` when the step was scheduled; while the engine stays busy the
    next step's ``start`` minus this one's is what the step really cost the streams, including the
    time between steps (draining the inbox, the event loop sharing the cores) that ``wall_s`` leaves out.
    """

    step_id: int
    start: float
    wall_s: float  # schedule, forward, sample, detokenise, deliver
    forward_s: float  # of which forward + sampling
    num_seqs: int
    features: dict[str, float]  # StepShape.features() of the plan
    after_idle: bool  # the engine had nothing to do just before: the gap before this step is idle time


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine. Preemption (docs/llm.md, "Preemption: recompute and swap"):
    ``num_preemptions`` = ``num_swapped_out + num_recompute_preemptions`` (sequences, since start-up)."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    fragmentation: float
    num_preemptions: int
    num_rejected: int
    num_steps: int
    num_generated_tokens: int
    tokens_per_s: float  # output tokens over the last ``window_s``
    prefix_cache_hit_tokens: int
    step_seconds: float = 0.0  # wall time of every step: schedule, forward, sample, detokenise, deliver
    forward_seconds: float = 0.0  # of which forward + sampling (what the step profile times)
    step_seqs: int = 0  # sequences summed over steps (step_seqs / num_steps = mean batch)
    # every step's cost-model features (StepShape.features), summed: the step model is linear, so its
    # prediction for all the steps run is its prediction on these sums, comparable with step_seconds
    step_features: dict[str, float] = dataclasses.field(default_factory=dict)
    num_timed_out: int = 0  # sequences the engine aborted at their deadline
    num_swapped: int = 0  # sequences swapped out now (their KV in host blocks), waiting to be swapped in
    num_swap_blocks: int = 0  # host swap space, in KV blocks
    num_free_swap_blocks: int = 0
    num_swapped_out: int = 0  # preemptions that copied the sequence's KV to host blocks
    num_swapped_in: int = 0  # swapped sequences copied back to device blocks
    num_recompute_preemptions: int = 0  # preemptions that freed the sequence's KV, to be prefilled again
    num_recomputed_tokens: int = 0  # computed tokens those recomputes threw away (before prefix-cache hits)
    num_blocks_swapped_out: int = 0  # KV blocks copied device -> host
    num_blocks_swapped_in: int = 0  # KV blocks copied host -> device
    swap_seconds: float = 0.0  # wall time of the block copies (part of step_seconds, not of forward_seconds)


@dataclass
class EngineCounters:
    """The engine thread's running totals, copied into each ``EngineStats``."""

    window_s: float = 5.0
    num_steps: int = 0
    num_generated_tokens: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    step_seqs: int = 0
    num_timed_out: int = 0
    swap_seconds: float = 0.0
    step_features: dict[str, float] = dataclasses.field(default_factory=dict)
    recent: collections.deque[tuple[float, int]] = dataclasses.field(default_factory=collections.deque)

    def add_tokens(self, now: float, n: int) -> None:
        self.num_generated_tokens += n
        self.recent.append((now, n))

    def add_step(self, num_seqs: int, features: dict[str, float], wall_s: float) -> None:
        self.num_steps += 1
        self.step_seqs += num_seqs
        self.step_seconds += wall_s
        for name, value in features.items():
            self.step_features[name] = self.step_features.get(name, 0.0) + value

    def snapshot(self, s: LLMScheduler, now: float) -> EngineStats:
        """These totals with the scheduler's queues, blocks and preemption counters, at ``now``."""
        b, p, sw = s.block_stats(), s.preemption, s.swap_space
        return EngineStats(
            s.num_running, s.num_waiting, b.num_blocks, b.num_free, b.usage, b.fragmentation,
            s.num_preemptions, s.num_rejected, self.num_steps, self.num_generated_tokens,
            self.tokens_per_s(now), b.num_cache_hit_tokens, self.step_seconds, self.forward_seconds,
            self.step_seqs, dict(self.step_features), self.num_timed_out, num_swapped=s.num_swapped,
            num_swap_blocks=sw.num_blocks, num_free_swap_blocks=sw.num_free_blocks,
            num_swapped_out=p.num_swapped_out, num_swapped_in=p.num_swapped_in,
            num_recompute_preemptions=p.num_recompute_preemptions,
            num_recomputed_tokens=p.num_recomputed_tokens, num_blocks_swapped_out=p.num_blocks_swapped_out,
            num_blocks_swapped_in=p.num_blocks_swapped_in, swap_seconds=self.swap_seconds)

    def tokens_per_s(self, now: float) -> float:
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / self.window_s
