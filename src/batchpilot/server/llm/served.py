"""The LLM engine as the server's routes, metrics and arms hold it: the runtime's ``Engine`` (submit,
check_room, stats, liveness, shutdown) plus what the server reads beside it.

``LLMEngine`` and the ``LLMFailover`` in front of one (``runtime/llm/failover.py``) are both one; the
server serves the failover, tests serve a bare engine. Declared here rather than on ``Engine`` because
the ``StaticFallback`` behind a failover is an ``Engine`` that the server never serves directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.runtime.llm.engine import Engine, PromptEncoder, TokenEvent


class ServedEngine(Engine, Protocol):
    """An ``Engine`` with the name clients send, its resolved scheduler config (context length,
    deadline, what ``/v1/arms`` shows), its prompt encoder and its per-token observers (the metrics)."""

    model_name: str
    config: LLMSchedulerConfig
    prompts: PromptEncoder
    observers: list[Callable[[TokenEvent], None]]
