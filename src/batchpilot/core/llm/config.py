"""The limits of one LLM engine (the ``llm:`` section of the config file): ``LLMSchedulerConfig``.

Plain data, validated on construction. Three groups of fields:

* **batching**: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``policy``,
  ``enable_chunked_prefill``, ``enable_prefix_caching``, ``max_priority_wait_s``, ``decode_run_tokens``;
* **admission**: ``max_waiting_seqs``, ``request_timeout_s``;
* **memory**: ``num_kv_blocks`` x ``block_size`` token slots of KV cache, or a memory budget the
  engine sizes the pool from (``kv_cache_memory`` bytes, else ``memory_utilization``, a share of the
  device's free memory: ``core/llm/config.py``); ``preemption`` and ``num_swap_blocks`` / ``swap_space``
  (host memory a preempted sequence's KV blocks may be copied to instead of being recomputed).

A config a scheduler runs is *resolved*: ``num_kv_blocks`` and ``num_swap_blocks`` are what the memory
plan gave. The budget fields stay as the user wrote them, so the plan can be checked and reported.

The KV memory plan (``plan_kv``: how many device and host blocks a memory budget holds) is the file's
last section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

LLMPolicy = Literal["fcfs", "priority", "fair"]
LLM_POLICIES: tuple[LLMPolicy, ...] = ("fcfs", "priority", "fair")  # fair: core/llm/fair.py
PreemptionMode = Literal["recompute", "swap", "auto"]
PREEMPTION_MODES: tuple[PreemptionMode, ...] = ("recompute", "swap", "auto")
DECODE_RUN_TOKENS = 2048  # decode_run_tokens's default (core/llm/scheduler.py, docs/llm.md "Decode runs")


@dataclass(frozen=True)
class LLMSchedulerConfig:
    """Limits of one engine. ``num_kv_blocks * block_size`` is the KV capacity in tokens.

    ``max_waiting_seqs`` and ``request_timeout_s`` bound admission (``core/llm/admission.py``, which
    every driver calls): at most ``max_num_seqs + max_waiting_seqs`` sequences admitted at once, and a
    request's deadline ``request_timeout_s`` after it was received (sooner if it asks), past which
    ``LLMScheduler.expire`` ends it. Unless set, ``core/llm/config.py`` takes them from the
    ``server:`` settings the user gave (``max_concurrency``, ``request_timeout_s``).

    ``max_priority_wait_s`` (policy ``priority`` only; 0 = strict priority, no aging): a sequence that
    has waited this long since its arrival goes ahead of every younger one, in arrival order (see
    ``core/llm/scheduler.py`` for the bound it gives).

    Memory: ``kv_cache_memory`` (bytes) or ``memory_utilization`` (a share in (0, 1] of the device's
    free memory at start-up, out of which the weights and the activation peak come first) size the KV
    pool; without either, ``num_kv_blocks`` is taken as given. ``preemption``: what happens to the
    sequence the scheduler preempts for memory: ``recompute`` (free its blocks, prefill it again),
    ``swap`` (copy its blocks to host memory and back), or ``auto`` (swap when the copy is cheaper than
    recomputing its tokens and host blocks are free, else recompute). ``swap_space`` (bytes; None = not
    given: ``num_swap_blocks`` is kept) is the host memory for swapped blocks; ``num_swap_blocks`` is
    what the memory plan makes of it (0 bytes: no swap).

    ``decode_run_tokens``: the most padded keys one run of decodes gathers and attends at once
    (``core.llm.scheduler.decode_groups``: the runner's layout and the step model's KV features alike).
    The default was measured on CPU, where a run's buffer past a few MiB leaves the caches; a GPU,
    where each run is a kernel launch per layer, wants far larger runs."""

    # "flag": the field's override flag (settings.add_field_flags; help "llm.<field> (default ...)"
    # where the metadata gives none), the same in serve --llm and simulate --target llm
    max_num_seqs: int = field(default=64, metadata={"flag": {}})
    max_num_batched_tokens: int = field(default=512, metadata={"flag": {}})
    num_kv_blocks: int = field(default=2048, metadata={"flag": {}})
    block_size: int = field(default=16, metadata={"flag": {}})
    max_model_len: int = field(default=2048, metadata={"flag": {}})
    policy: LLMPolicy = field(default="fcfs", metadata={"flag": {
        "name": "--scheduling-policy", "choices": LLM_POLICIES}})
    enable_chunked_prefill: bool = field(default=True, metadata={"flag": {}})
    enable_prefix_caching: bool = field(default=False, metadata={"flag": {}})
    eos_token_ids: tuple[int, ...] = ()
    max_waiting_seqs: int = field(default=256, metadata={"flag": {}})
    request_timeout_s: float = field(default=600.0, metadata={"flag": {
        "name": "--llm-request-timeout-s",
        "help": "{key}: a completion not done by then ends with 504 (or an SSE error event) and its sequence "
                "is freed (default: --request-timeout-s when given, else {default:g})"}})
    max_priority_wait_s: float = field(default=10.0, metadata={"flag": {}})
    # policy fair: a tenant whose waiting queue was empty is served ahead for this many prompt tokens'
    # worth of service (its burst, repaid later: core/llm/fair.py)
    fair_burst_tokens: int = 8192
    kv_cache_memory: int | None = field(default=None, metadata={"flag": {
        "unit": "bytes", "metavar": "SIZE",
        "help": "{key}: bytes of KV cache (4GiB, 512MiB, 2e9); sizes the pool"}})
    memory_utilization: float | None = field(default=None, metadata={"flag": {
        "aliases": ("--gpu-memory-utilization",), "type": float, "metavar": "SHARE",
        "help": "{key}: the share in (0, 1] of the device's free memory at start-up the engine may use; "
                "the KV pool is what weights and the activation peak leave"}})
    preemption: PreemptionMode = field(default="auto", metadata={"flag": {
        "choices": PREEMPTION_MODES,
        "help": "{key}: recompute, swap, or auto (swap when copying is cheaper than recomputing; "
                "default {default})"}})
    swap_space: int | None = field(default=None, metadata={"flag": {
        "unit": "gib", "metavar": "SIZE",
        "help": "{key}: host memory for swapped-out KV blocks (a bare number is GiB, here and in the file; "
                "default: none, no swap)"}})
    num_swap_blocks: int = 0
    decode_run_tokens: int = field(default=DECODE_RUN_TOKENS, metadata={"flag": {}})

    def __post_init__(self) -> None:
        limits = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size", "max_model_len",
                  "decode_run_tokens")
        for name in limits:
            if getattr(self, name) < 1:
                raise ValueError(f"llm_scheduler.{name} must be >= 1, got {getattr(self, name)}")
        if self.fair_burst_tokens < 0:
            raise ValueError(f"llm_scheduler.fair_burst_tokens must be >= 0, got {self.fair_burst_tokens}")
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
        if self.policy not in LLM_POLICIES:
            raise ValueError(f"llm_scheduler.policy = {self.policy!r}; choose one of "
                             f"{', '.join(LLM_POLICIES)}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


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




# -- The KV memory plan ----------------------------------------------------------------------------
# The LLM engine's memory plan: how many KV blocks (and host swap blocks) a memory budget holds.
#
# ``plan_kv(config, memory, free_bytes)`` is the one place the pool is sized: the live engine calls it
# at start-up with the device's free memory, the simulator with the profile's, so both run the same
# ``num_kv_blocks``. It is pure arithmetic over a ``MemoryProfile`` (what the profiler measured, or what
# the builder computed from the model's tensors):
#
# ```
#  budget  = kv_cache_memory                      (given in bytes)          -> kv = budget
#          | memory_utilization x free_bytes       (a share of free memory)  -> kv = budget - fixed
#  fixed   = weights + overhead + activation peak of the largest step (+ swap space, where it is the
#            same memory)
#  activation peak = fixed_bytes + per_token x max_num_batched_tokens + per_read_token x kv_read_max
#                    + per_attn x max_num_batched_tokens x max_model_len   (a prefill chunk at the end
#                                                    of the longest sequence: its mask and scores)
#  kv_read_max     = core.llm.scheduler.largest_gather(config)   (the largest gather of a step: one
#  sequence of
#                    max_model_len, or a run of decodes within decode_run_tokens padded keys, in blocks)
#  num_kv_blocks   = kv // (kv_bytes_per_token x block_size)
# ```
#
# Without a budget the config's ``num_kv_blocks`` is kept. Either way the plan is then checked, and
# ``KVPlanError`` says what to change: the pool must hold one ``max_model_len`` sequence, and (when the
# free memory is known) weights + activation + KV (+ swap space, where it is the same memory) must fit in
# it. ``swap_space`` bytes become ``num_swap_blocks`` host blocks of the same size.

MIB = 1 << 20


def _mib(x: float) -> str:
    return f"{x / MIB:.1f} MiB"


class KVPlanError(ValueError):
    """The requested memory cannot hold the engine; the message says what to change."""


@dataclass(frozen=True)
class MemoryProfile:
    """What one engine's memory is made of, in bytes.

    ``weights_bytes``: the model's tensors on the device; ``kv_bytes_per_token``: K and V of one token
    over every layer; the activation peak of one step above weights and KV, linear in the step's
    batched tokens, in the context tokens its largest gather holds, and in a late prefill chunk's
    tokens x context: ``activation_fixed_bytes + activation_bytes_per_token x tokens +
    activation_bytes_per_read_token x read tokens + activation_bytes_per_attn x chunk x context``.
    ``source`` says where the activation terms came from ("measured" by the profiler, or "none").
    ``overhead_bytes``: what the engine's process holds beyond its tensors (the tokenizer, the loader's
    freed-but-kept pages, Python objects), measured as the resident growth while the model loaded minus
    the weights (0 on CUDA, where torch's allocations are the device memory)."""

    weights_bytes: int
    kv_bytes_per_token: int
    activation_fixed_bytes: float = 0.0
    activation_bytes_per_token: float = 0.0
    activation_bytes_per_read_token: float = 0.0
    source: str = "none"
    activation_bytes_per_attn: float = 0.0
    overhead_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"memory profile: kv_bytes_per_token must be >= 1, "
                             f"got {self.kv_bytes_per_token}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and v < 0:
                raise ValueError(f"memory profile: {f.name} must be >= 0, got {v}")

    def activation_bytes(self, tokens: int, read_tokens: int, attn: int = 0) -> float:
        return (self.activation_fixed_bytes + self.activation_bytes_per_token * tokens
                + self.activation_bytes_per_read_token * read_tokens + self.activation_bytes_per_attn * attn)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"memory profile: unknown field(s) {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class KVPlan:
    """The sized pool and what it was sized from (bytes; ``free_bytes`` None = not known)."""

    num_kv_blocks: int
    num_swap_blocks: int
    block_size: int
    block_bytes: int
    weights_bytes: int
    activation_bytes: float
    free_bytes: float | None
    budget_bytes: float | None  # what the user's budget gave (None: num_kv_blocks was given)
    source: str  # "num_kv_blocks" | "kv_cache_memory" | "memory_utilization"
    max_model_len: int  # the config's, or the pool's capacity where the plan was allowed to cap it
    overhead_bytes: float = 0.0

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.block_bytes

    @property
    def swap_bytes(self) -> int:
        return self.num_swap_blocks * self.block_bytes

    @property
    def planned_bytes(self) -> float:
        """Device memory the engine is planned to use: weights, overhead, the activation peak, the KV pool."""
        return self.weights_bytes + self.overhead_bytes + self.activation_bytes + self.kv_bytes

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def describe(self) -> str:
        free = "unknown" if self.free_bytes is None else f"{self.free_bytes / MIB:.0f} MiB"
        return (f"KV pool {self.num_kv_blocks} blocks x {self.block_size} tokens = {self.num_kv_tokens} "
                f"tokens ({_mib(self.kv_bytes)}, from {self.source}); weights {_mib(self.weights_bytes)}, "
                f"overhead {_mib(self.overhead_bytes)}, activation peak {_mib(self.activation_bytes)}; "
                f"planned {_mib(self.planned_bytes)} of {free} free; swap {self.num_swap_blocks} blocks "
                f"({_mib(self.swap_bytes)})")

    def resolve(self, config: LLMSchedulerConfig) -> LLMSchedulerConfig:
        """``config`` with the planned block counts: what the scheduler and the runner are built with."""
        return dataclasses.replace(config, num_kv_blocks=self.num_kv_blocks,
                                   num_swap_blocks=self.num_swap_blocks, max_model_len=self.max_model_len)


def plan_kv(config: LLMSchedulerConfig, memory: MemoryProfile, free_bytes: float | None = None,
            swap_on_device: bool = True, cap_max_model_len: bool = False) -> KVPlan:
    """Size the KV pool for ``config`` (see the module docstring); raise ``KVPlanError`` if it cannot hold
    the engine. ``free_bytes``: the device's free memory before the model loaded (None: unknown, the fit
    check is skipped and a ``memory_utilization`` budget is an error). ``swap_on_device``: the host swap
    space is the same memory as the pool (CPU), so it counts against ``free_bytes``.
    ``cap_max_model_len``: ``max_model_len`` was not given but taken from the model, so a pool too
    small for it lowers it to the pool's capacity (``KVPlan.max_model_len``) instead of failing."""
    c = config
    block_bytes = memory.kv_bytes_per_token * c.block_size
    activation = memory.activation_bytes(c.max_num_batched_tokens, largest_gather(c),
                                         c.max_num_batched_tokens * c.max_model_len)
    num_swap = int(c.swap_space // block_bytes) if c.swap_space is not None else c.num_swap_blocks
    fixed = (memory.weights_bytes + memory.overhead_bytes + activation
             + (num_swap * block_bytes if swap_on_device else 0))
    budget: float | None = None
    if c.kv_cache_memory is not None:
        source, budget = "kv_cache_memory", float(c.kv_cache_memory)
        kv = budget
    elif c.memory_utilization is not None:
        source = "memory_utilization"
        if free_bytes is None:
            raise KVPlanError("memory_utilization needs the device's free memory, which is not known here; "
                              "give kv_cache_memory (bytes) or num_kv_blocks instead")
        budget = c.memory_utilization * free_bytes
        kv = budget - fixed
        if kv < block_bytes:
            raise KVPlanError(
                f"memory_utilization {c.memory_utilization} of {_mib(free_bytes)} free is {_mib(budget)}, "
                f"which the weights ({_mib(memory.weights_bytes)}), the overhead "
                f"({_mib(memory.overhead_bytes)}), the activation peak ({_mib(activation)}, "
                f"{c.max_num_batched_tokens} batched tokens, a gather of {largest_gather(c)} tokens) and "
                f"the swap space ({_mib(num_swap * block_bytes if swap_on_device else 0)}) leave no room for "
                f"KV; raise memory_utilization, or lower max_num_batched_tokens, max_model_len, "
                f"decode_run_tokens or swap_space")
    else:
        source, kv = "num_kv_blocks", float(c.num_kv_blocks * block_bytes)
    num_blocks = int(kv // block_bytes)
    need = -(-c.max_model_len // c.block_size)
    max_model_len = c.max_model_len
    if num_blocks < need and cap_max_model_len and num_blocks >= 1:
        max_model_len = num_blocks * c.block_size
    plan = KVPlan(num_blocks, num_swap, c.block_size, block_bytes, memory.weights_bytes, activation,
                  free_bytes, budget, source, max_model_len, memory.overhead_bytes)
    if num_blocks < need and max_model_len == c.max_model_len:
        raise KVPlanError(
            f"the KV pool ({num_blocks} blocks of {c.block_size} tokens = {plan.num_kv_tokens} tokens, "
            f"{_mib(plan.kv_bytes)}, from {source}) cannot hold one sequence of max_model_len = "
            f"{c.max_model_len} tokens ({need} blocks, {_mib(need * block_bytes)}); give more KV memory "
            f"(kv_cache_memory, "
            f"memory_utilization or num_kv_blocks) or lower max_model_len")
    if c.preemption == "swap" and num_swap < 1:
        raise KVPlanError(f"preemption = swap needs host swap space for at least one block "
                          f"({_mib(block_bytes)}); set swap_space (bytes), or choose preemption auto or "
                          f"recompute")
    if free_bytes is not None:
        total = plan.planned_bytes + (plan.swap_bytes if swap_on_device else 0)
        if total > free_bytes:
            swap = f" + swap {_mib(plan.swap_bytes)}" if swap_on_device and num_swap else ""
            raise KVPlanError(
                f"the plan needs {_mib(total)} (weights {_mib(memory.weights_bytes)} + overhead "
                f"{_mib(memory.overhead_bytes)} + activation peak "
                f"{_mib(activation)} + KV {_mib(plan.kv_bytes)}{swap}) but only {_mib(free_bytes)} is free; "
                f"lower num_kv_blocks / kv_cache_memory / swap_space, or use memory_utilization to size the "
                f"pool from the free memory")
    return plan


