"""The limits of one LLM engine (the ``llm:`` section of the config file): ``LLMSchedulerConfig``.

Plain data, validated on construction. Three groups of fields:

* **batching**: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``policy``,
  ``enable_chunked_prefill``, ``enable_prefix_caching``, ``max_priority_wait_s``, ``decode_run_tokens``;
* **admission**: ``max_waiting_seqs``, ``request_timeout_s``;
* **memory**: ``num_kv_blocks`` x ``block_size`` token slots of KV cache, or a memory budget the
  engine sizes the pool from (``kv_cache_memory`` bytes, else ``memory_utilization``, a share of the
  device's free memory: ``core/kv_plan.py``); ``preemption`` and ``num_swap_blocks`` / ``swap_space``
  (host memory a preempted sequence's KV blocks may be copied to instead of being recomputed).

A config a scheduler runs is *resolved*: ``num_kv_blocks`` and ``num_swap_blocks`` are what the memory
plan gave. The budget fields stay as the user wrote them, so the plan can be checked and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LLMPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap", "auto"]
PREEMPTION_MODES: tuple[PreemptionMode, ...] = ("recompute", "swap", "auto")
DECODE_RUN_TOKENS = 2048  # decode_run_tokens's default (core/llm_plan.py, docs/llm.md "Decode runs")


@dataclass(frozen=True)
class LLMSchedulerConfig:
    """Limits of one engine. ``num_kv_blocks * block_size`` is the KV capacity in tokens.

    ``max_waiting_seqs`` and ``request_timeout_s`` bound admission (``core/llm_admission.py``, which
    every driver calls): at most ``max_num_seqs + max_waiting_seqs`` sequences admitted at once, and a
    request's deadline ``request_timeout_s`` after it was received (sooner if it asks), past which
    ``LLMScheduler.expire`` ends it. Unless set, ``core/llm_deployment.py`` takes them from the
    ``server:`` settings the user gave (``max_concurrency``, ``request_timeout_s``).

    ``max_priority_wait_s`` (policy ``priority`` only; 0 = strict priority, no aging): a sequence that
    has waited this long since its arrival goes ahead of every younger one, in arrival order (see
    ``core/llm_scheduler.py`` for the bound it gives).

    Memory: ``kv_cache_memory`` (bytes) or ``memory_utilization`` (a share in (0, 1] of the device's
    free memory at start-up, out of which the weights and the activation peak come first) size the KV
    pool; without either, ``num_kv_blocks`` is taken as given. ``preemption``: what happens to the
    sequence the scheduler preempts for memory: ``recompute`` (free its blocks, prefill it again),
    ``swap`` (copy its blocks to host memory and back), or ``auto`` (swap when the copy is cheaper than
    recomputing its tokens and host blocks are free, else recompute). ``swap_space`` (bytes; None = not
    given: ``num_swap_blocks`` is kept) is the host memory for swapped blocks; ``num_swap_blocks`` is
    what the memory plan makes of it (0 bytes: no swap).

    ``decode_run_tokens``: the most padded keys one run of decodes gathers and attends at once
    (``core.llm_plan.decode_groups``: the runner's layout and the step model's KV features alike).
    The default was measured on CPU, where a run's buffer past a few MiB leaves the caches; a GPU,
    where each run is a kernel launch per layer, wants far larger runs."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    num_kv_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 2048
    policy: LLMPolicy = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_waiting_seqs: int = 256
    request_timeout_s: float = 600.0
    max_priority_wait_s: float = 10.0
    kv_cache_memory: int | None = None
    memory_utilization: float | None = None
    preemption: PreemptionMode = "auto"
    swap_space: int | None = None
    num_swap_blocks: int = 0
    decode_run_tokens: int = DECODE_RUN_TOKENS

    def __post_init__(self) -> None:
        limits = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size", "max_model_len",
                  "decode_run_tokens")
        for name in limits:
            if getattr(self, name) < 1:
                raise ValueError(f"llm_scheduler.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_seqs < 0:
            raise ValueError(f"llm_scheduler.max_waiting_seqs must be >= 0, got {self.max_waiting_seqs}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"llm_scheduler.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.max_priority_wait_s >= 0:
            raise ValueError(f"llm_scheduler.max_priority_wait_s must be >= 0 seconds (0 = no aging), "
                             f"got {self.max_priority_wait_s}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"llm_scheduler.kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"llm_scheduler.memory_utilization must be in (0, 1], "
                             f"got {self.memory_utilization}")
        if self.kv_cache_memory is not None and self.memory_utilization is not None:
            raise ValueError("llm_scheduler: give kv_cache_memory or memory_utilization, not both")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"llm_scheduler.preemption = {self.preemption!r}; choose one of "
                             f"{', '.join(PREEMPTION_MODES)}")
        for name in ("swap_space", "num_swap_blocks"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"llm_scheduler.{name} must be >= 0, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"llm_scheduler.policy = {self.policy!r}; choose one of fcfs, priority")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
