"""What a preempted sequence costs to bring back, and the rule that picks swap or recompute for it.

When the scheduler must take a running sequence's KV blocks, the sequence can come back two ways:

* **recompute**: its blocks are freed and, when it is admitted again, its ``num_computed_tokens``
  (prompt + outputs so far) are prefilled again;
* **swap**: its blocks are copied to host memory (``core/swap_space.py``), freed, and copied back into
  fresh device blocks before it runs again; nothing is computed twice.

``PreemptionCosts`` prices both in seconds, from measured figures (never a machine's constants):

    swap       num_blocks * (swap_out_s_per_block + swap_in_s_per_block)
    recompute  prefill_s_per_token * T + prefill_s_per_attn * T * T      (T = num_computed_tokens)

The recompute price is the marginal cost the step cost model (``core/costmodel.py``, ``LLM_FEATURES``)
gives a prefill chunk of ``T`` tokens from position 0: ``T`` prefill tokens, ``T`` KV tokens read and
``T * T`` units of prefill attention (a recompute split into chunks reads no more than that). The
step's fixed cost is left out: a recompute shares a step with other work.

``choose(mode, costs, ...)`` is the whole decision:

* ``recompute``: never swap;
* ``swap``: swap whenever the host has room for the sequence's blocks;
* ``auto``: swap when the host has room and the swap round trip is cheaper than the recompute; without
  costs (``None``) or without swap space, recompute.

In every mode a sequence with no computed tokens is recomputed (nothing to copy), and so is one holding
a block shared with another sequence (prefix caching, reference count > 1): freeing a shared block gives
no memory back, and the shared prefix stays on the device, keyed in the prefix cache, so its recompute
is served from the cache for that prefix instead of computed again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from batchpilot.core.costmodel import CostModel
from batchpilot.core.llm_config import PreemptionMode

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
