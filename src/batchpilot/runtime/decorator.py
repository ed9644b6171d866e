"""``@batch``: batchpilot's policies around any function of a list, with Ray ``@serve.batch`` ergonomics.

    @batch(policy="hybrid", max_batch_size=32, max_wait_s=0.01, length=len)
    async def embed(texts: list[str]) -> list[list[float]]: ...

    vector = await embed("one text")          # callers pass ONE item and get ONE result

The wrapped function receives a list of items and returns one result per item, in order. It may be
``async def`` (awaited on the event loop) or a plain function (run in a worker thread, so it may block,
e.g. a torch forward). Methods work too: each instance gets its own Batcher. ``length(item)`` gives the
cost unit the policies and planner use (tokens for text models; 1 per item by default).

A Batcher is bound to one event loop, so the wrapper keeps one per running loop (``asyncio.run`` in
tests and scripts creates a fresh loop each time); ``await embed.shutdown()`` drains the current one.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.batcher import Batcher
from batchpilot.runtime.executor import AsyncCallableExecutor, CallableExecutor

# A generic callable has no position limit (length is only a cost unit), but the core's admission
# precomputes a table per length up to the limit, so the default bound stays moderate.
DEFAULT_MAX_LENGTH = 65_536


def make_config(policy: str = "hybrid", max_batch_size: int = 32, max_wait_s: float = 0.01,
                grouping: str = "fifo", max_length: int | None = None, num_slots: int = 1,
                **policy_options: Any) -> SchedulerConfig:
    """A SchedulerConfig for a generic callable: ``length(item)`` above ``max_length`` (default 65536) is
    rejected with ``TOO_LONG``."""
    limit = max_length or DEFAULT_MAX_LENGTH
    return SchedulerConfig(
        policy=PolicyConfig(name=policy, max_batch_size=max_batch_size,  # type: ignore[arg-type]
                            max_wait_s=max_wait_s, **policy_options),
        planner=PlannerConfig(grouping=grouping, padding="dynamic", max_len=limit),  # type: ignore[arg-type]
        admission=AdmissionConfig(max_length=limit),
        num_slots=num_slots,
    )


class BatchedFunction:
    """The callable ``@batch`` returns: ``await f(item, priority=0, deadline=None, sla=None)``."""

    def __init__(self, fn: Callable[..., Any], config: SchedulerConfig, cost_model: CostModel | None,
                 length: Callable[[Any], int] | None, instance: Any = None) -> None:
        self.fn = fn
        self.config = config
        self.cost_model = cost_model
        self.length = length
        self._instance = instance
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Batcher] = (
            weakref.WeakKeyDictionary())
        functools.update_wrapper(self, fn)

    def __get__(self, instance: Any, owner: type | None = None) -> BatchedFunction:
        if instance is None:
            return self
        # One Batcher per instance (a batch must not mix two objects' ``self``), cached in the instance's
        # __dict__ like functools.cached_property: later lookups find it there and skip this method.
        bound = BatchedFunction(self.fn, self.config, self.cost_model, self.length, instance)
        try:
            instance.__dict__[self.fn.__name__] = bound
        except AttributeError as exc:
            raise TypeError(f"@batch on {type(instance).__name__}.{self.fn.__name__}: the class needs a "
                            "__dict__ (no __slots__) to keep its per-instance Batcher") from exc
        return bound

    def batcher(self) -> Batcher:
        """The Batcher serving the running event loop (created on first use)."""
        loop = asyncio.get_running_loop()
        b = self._batchers.get(loop)
        if b is None or b.health == "stopped":
            target = self.fn if self._instance is None else functools.partial(self.fn, self._instance)
            is_async = inspect.iscoroutinefunction(self.fn)
            executor = AsyncCallableExecutor(target) if is_async else CallableExecutor(target)
            # the Batcher awaits an async ``run`` (``Batcher._run_is_async``), which runtime/executor.py's
            # ``Executor`` protocol does not declare yet: the ignore goes once it has an async counterpart
            b = Batcher(executor, self.config, self.cost_model or _flat_cost_model())  # type: ignore[arg-type]
            self._batchers[loop] = b
        return b

    async def __call__(self, item: Any, *, priority: int = 0, deadline: float | None = None,
                       sla: float | None = None) -> Any:
        length = max(1, int(self.length(item))) if self.length is not None else 1
        return await self.batcher().submit(item, length, priority=priority, deadline=deadline, sla=sla)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        b = self._batchers.get(asyncio.get_running_loop())
        if b is not None:
            await b.shutdown(drain_timeout)


def _flat_cost_model() -> CostModel:
    """Without a profile, assume a call costs the same whatever its size: the policies then batch
    on counts and time alone instead of pretending to know an unknown function's latency curve."""
    return CostModel(latency_coef=(0.001, 0.0, 0.0, 0.0), meta={"source": "flat"})


def batch(fn: Callable[..., Any] | None = None, *, policy: str = "hybrid", max_batch_size: int = 32,
          max_wait_s: float = 0.01, length: Callable[[Any], int] | None = None,
          config: SchedulerConfig | None = None, cost_model: CostModel | None = None,
          **options: Any) -> Any:
    """Decorate ``fn(list_of_items) -> list_of_results`` so callers await one item at a time.

    ``config`` (e.g. ``SchedulerConfig.from_dict`` of a tuned YAML) overrides the keyword shortcuts;
    other keywords go to ``make_config`` (``grouping``, ``max_length``, ``num_slots``, any policy option).
    """
    cfg = config or make_config(policy, max_batch_size, max_wait_s, **options)

    def wrap(f: Callable[..., Any]) -> BatchedFunction:
        return BatchedFunction(f, cfg, cost_model, length)

    return wrap(fn) if fn is not None else wrap
