"""What the LLM engine hands out: streamed outputs, token and step events for observers, and its stats."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass


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

    def tokens_per_s(self, now: float) -> float:
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / self.window_s
