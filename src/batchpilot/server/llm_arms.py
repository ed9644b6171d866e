"""The LLM served in arms: an engine per arm (each its own scheduler config, paged KV cache and engine
thread) over the same weights, assigned, compared and rolled back by the same ``ArmedModel`` as the
encoders' arms (``server/arms.py``).

    arms = LLMArms([primary_engine, canary_engine], rollout)
    make_llm_router(primary_engine, registry, arms=arms)     # picks the arm of each request

A request's outcome is recorded when its response starts: for a stream the time to its first token,
otherwise the whole answer. ``/v1/arms`` shows each arm's engine settings beside its KV use, KV
fragmentation, preemptions and queue, read from the engine when asked. Every LLM series carries
``arm=<name>``; the arm series (share, rollbacks) carry ``model=<the LLM's name>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from batchpilot.core.rollout import RolloutSpec
from batchpilot.server.arms import ArmedModel
from batchpilot.server.metrics import ModelLabels


def describe_engine(engine: Any) -> dict[str, Any]:
    """An LLM arm's settings and its KV cache now, as ``/v1/arms`` shows them."""
    c, s = engine.config, engine.stats()
    return {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
            "num_kv_blocks": c.num_kv_blocks, "block_size": c.block_size, "policy": c.policy,
            "enable_chunked_prefill": c.enable_chunked_prefill,
            "enable_prefix_caching": c.enable_prefix_caching,
            "kv_usage": s.kv_usage, "kv_fragmentation": s.fragmentation, "preemptions": s.num_preemptions,
            "running": s.num_running, "waiting": s.num_waiting}


class LLMArms:
    def __init__(self, engines: Sequence[Any], rollout: RolloutSpec) -> None:
        self.armed = ArmedModel(engines[0].model_name, engines, rollout, describe_engine)
        self.registries = {name: CollectorRegistry() for name in self.armed.backends}

    @property
    def engines(self) -> dict[str, Any]:
        return self.armed.backends

    def register(self, registry: CollectorRegistry) -> dict[str, CollectorRegistry]:
        """Show every arm's series on the server's ``registry``, labelled; each arm's own registry (its
        ``LLMMetrics`` go there)."""
        sources = [({"arm": name}, reg) for name, reg in self.registries.items()]
        registry.register(ModelLabels([*sources, ({"model": self.armed.model_name}, self.armed.registry)]))
        return self.registries

    def shutdown(self, timeout: float = 10.0) -> None:
        for engine in self.engines.values():
            engine.shutdown(timeout)
