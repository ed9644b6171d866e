"""The LLM engine the routes talk to: the continuous-batching engine while it is healthy, a fallback engine
while it is not, and a watchdog thread that decides which, with a circuit breaker (``core.breaker``).

Faults, and what happens on each:

* ``died``: the engine loop ended by itself (an exception outside a step);
* ``stalled``: a step has run past the stall bound (``core.stall``, from the engine's own step times,
  or a fixed ``--llm-stall-timeout-s``), seen by the watchdog within ``poll_s``;
* ``oom``: a step raised an out-of-memory error (reported by the requests of that step).

On a fault the breaker opens, and the engine is retired (``LLMEngine.retire``): it takes nothing more, and
every request it holds is answered at once (``EngineStopped``, from this thread even when the engine
thread is stuck in a step). A request that has shown its client nothing moves to the fallback
(``FailoverRequest``); a stream under way ends with an error event. While open, new requests go to the
fallback, or are refused with ``EngineUnavailable`` (503 ``engine_unavailable`` + Retry-After) when there
is none.

When the probe is due (``BreakerConfig.probe_interval_s``, backing off while probes fail) and the retired
engine's thread has ended (a stuck step must return first: two threads never share the runner), a new
engine is built (``LLMEngine.rebuilt``) on the same runner, tokenizer, config, counters and observers,
with a fresh scheduler (every KV block free: nothing of the old state is trusted), and given one probe
request (one token). If it answers, the breaker closes and traffic returns to it; if not, it is retired
too and the breaker opens again. The fallback is watched too (``fallback_watchdog``, over its decoding
steps): a dead or stalled fallback is abandoned and rebuilt on its model once its call returns.

In this file: the watchdog (``EngineWatchdog``), the request handle that can move to the fallback
(``FailoverRequest``) and the failover itself (``LLMFailover``, an ``Engine`` of
``runtime/llm/engine.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchpilot.core.breaker import BreakerConfig, CircuitBreaker
from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.core.request import DEFAULT_TENANT
from batchpilot.core.stall import StallRule, StallWatch
from batchpilot.core.tenants import TenantState, TenantTable, merged_usage
from batchpilot.runtime.llm.engine import (
    NO_TENANT,
    Engine,
    EngineStats,
    EngineStopped,
    EngineUnavailable,
    GenerationFailed,
    GenerationOutput,
    GenerationStream,
    LLMEngine,
    StepRecord,
    Tenant,
)

if TYPE_CHECKING:  # the fallback module imports torch at once; the failover runs without a fallback too
    from batchpilot.runtime.llm.fallback import StaticFallback

log = logging.getLogger("batchpilot.llm")

DIED, STALLED, OUT_OF_MEMORY = "died", "stalled", "oom"  # the fault kinds (metrics label ``kind``)


class EngineWatchdog:
    """Has an engine's thread died, or has the step under way run past its bound?

    A step observer (``on_step``) feeds each step's wall time to the stall rule (``core.stall``); ``check``
    compares the engine's ``busy_since`` (stamped by the engine thread when a step begins, cleared when
    it ends) with the bound the measured step times give. Work that waits for a step that never ends is
    exactly "busy past the bound": an idle engine has no step under way and is never stalled.
    The failover calls ``check`` from its own thread on the live clock."""

    def __init__(self, rule: StallRule | None = None) -> None:
        self._watch = StallWatch(rule)
        self._lock = threading.Lock()  # steps are recorded on the engine thread, checked on another

    def on_step(self, rec: StepRecord) -> None:
        with self._lock:
            self._watch.record(rec.wall_s)

    def timeout_s(self) -> float:
        with self._lock:
            return self._watch.timeout_s()

    def check(self, engine: LLMEngine | StaticFallback, now: float) -> str | None:
        """``DIED`` (the loop ended by itself), ``STALLED`` (a step past the bound) or None (healthy).
        ``now`` is on ``time.monotonic``, the clock of ``engine.busy_since``."""
        if engine.failure is not None or not engine.is_alive:
            return DIED
        with self._lock:
            overdue = self._watch.overdue_s(engine.busy_since, now)
        return STALLED if overdue is not None else None


class FailoverRequest:
    """One request as the failover hands it out: the main engine's sequence, or the fallback's after a fault.

    Iterated like an ``LLMRequest``. When the engine under it fails (``EngineStopped`` from a dead, stalled
    or retired engine; ``GenerationFailed`` caused by an out-of-memory error) the failover hears of the
    fault, and the request moves to the fallback engine if nothing of it has reached the client yet:

    * a streamed request, before its first output (the route awaits that before the response starts);
    * a ``replayable`` request (not streamed) at any point: it collects every output before handing any
      out, so a fault mid-way restarts it on the fallback from its prompt and the client sees one answer.

    Otherwise (a stream already under way, no fallback, the fallback failing too) the failure reaches the
    client as ``EngineUnavailable``; a failure that is not the engine's (a model error on this input, a
    deadline) reaches it as it is. Either way the request is answered once."""

    def __init__(self, owner: LLMFailover, prompt: list[int], params: SamplingParams, priority: int,
                 deadline: float | None, inner: GenerationStream, engine: Engine, replayable: bool,
                 tenant: Tenant = NO_TENANT) -> None:
        self.owner, self.prompt, self.params, self.tenant = owner, prompt, params, tenant
        self.priority, self.deadline = priority, deadline
        self.inner, self.engine = inner, engine  # the LLMRequest and the engine it is on
        self.replayable = replayable
        self._ready: deque[GenerationOutput] | None = None  # replayable: the whole answer, once complete
        self._handed_out = False
        self.moves = 0  # times moved to a fallback

    @property
    def seq_id(self) -> int:
        return self.inner.seq_id

    def __aiter__(self) -> FailoverRequest:
        return self

    async def __anext__(self) -> GenerationOutput:
        if not self.replayable:
            item = await self._next()
            self._handed_out = True
            return item
        if self._ready is None:
            self._ready = deque(await self._whole())
        if not self._ready:
            raise StopAsyncIteration
        return self._ready.popleft()

    async def _whole(self) -> list[GenerationOutput]:
        items: list[GenerationOutput] = []
        while True:
            moves = self.moves
            try:
                item = await self._next()
            except StopAsyncIteration:
                return items
            if self.moves != moves:
                items.clear()  # restarted on the fallback: what the failed engine gave is dropped
            items.append(item)
            if item.finish_reason is not None:
                return items

    async def _next(self) -> GenerationOutput:
        while True:  # after a move, the next output comes from the fallback
            try:
                return await self.inner.__anext__()
            except (EngineStopped, GenerationFailed) as exc:
                if not self._move(exc):
                    raise self._for_client(exc) from None

    def _kind(self, exc: BaseException) -> str | None:
        if isinstance(exc, GenerationFailed):
            return OUT_OF_MEMORY if exc.out_of_memory else None
        return DIED

    def _move(self, exc: BaseException) -> bool:
        """Report the engine's fault; move to the fallback if the client has seen nothing yet."""
        kind = self._kind(exc)
        if kind is None or self.owner.closing:
            return False
        self.owner.report(self.engine, kind)
        if self._handed_out or self.engine is self.owner.fallback:
            return False
        moved = self.owner.resubmit(self)
        if moved is None:
            return False
        self.inner.close()
        self.inner, self.engine = moved
        self.moves += 1
        return True

    def _for_client(self, exc: BaseException) -> BaseException:
        if self._kind(exc) is None or self.owner.closing:
            return exc
        return EngineUnavailable(retry_after_s=self.owner.retry_after_s())

    def close(self) -> None:
        self.inner.close()


# -- The failover ------------------------------------------------------------------------------------

class LLMFailover:
    """The engine behind its watchdog, breaker and fallback (see the module docstring): an ``Engine``."""

    def __init__(self, engine: LLMEngine, fallback: StaticFallback | None = None,
                 stall: StallRule | None = None, breaker: BreakerConfig | None = None, poll_s: float = 0.05,
                 start: bool = True, fallback_stall: StallRule | None = None) -> None:
        self.main = engine
        self.fallback = fallback
        self.tenant_label: Callable[[str], str] = str  # a tenant's metric label (``set_tenants``)
        self.model_name, self.config, self.prompts = engine.model_name, engine.config, engine.prompts
        self.observers, self.step_observers = engine.observers, engine.step_observers  # kept on rebuilds
        self.max_admitted = engine.max_admitted
        self.watchdog = EngineWatchdog(stall)
        self.step_observers.insert(0, self.watchdog.on_step)
        self.breaker = CircuitBreaker(breaker or BreakerConfig())
        self.poll_s = poll_s
        self.faults: collections.Counter[str] = collections.Counter()
        self.fallback_watchdog = EngineWatchdog(fallback_stall or stall)  # its decoding steps
        self.fallback_faults: collections.Counter[str] = collections.Counter()
        self.fallback_failed = False  # abandoned; rebuilt once its thread has ended
        if fallback is not None:
            fallback.step_observers.append(self.fallback_watchdog.on_step)
        self.fallback_requests = 0  # requests the fallback took: sent there, or moved there
        self.closing = False
        self._main_failed = False  # the engine in ``main`` has faulted (its faults count once)
        self._retired: list[LLMEngine] = []  # faulted engines whose thread may still be running
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llm-watchdog", daemon=True)
        if start:
            self._thread.start()

    # -- what the routes, metrics and /health read -------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """The continuous-batching engine is serving (what /health reports)."""
        with self._lock:
            return self._main_ok()

    @property
    def fallback_active(self) -> bool:
        with self._lock:
            return not self._main_ok() and self.fallback is not None and self.fallback.is_alive

    @property
    def num_pending(self) -> int:
        return self.main.num_pending + (self.fallback.num_pending if self.fallback else 0)

    def stats(self) -> EngineStats:
        return self.main.stats()

    def retry_after_s(self) -> float:
        return float(self.breaker.interval_s)

    def check_room(self, n: int = 1, tenant: str = DEFAULT_TENANT) -> None:
        self._target().check_room(n, tenant)

    def set_tenants(self, table: TenantTable, label: Callable[[str], str]) -> None:
        """As ``LLMEngine.set_tenants``, on the engine and its fallback."""
        self.tenant_label = label
        for engine in (self.main, self.fallback):
            if engine is not None:
                engine.set_tenants(table, label)

    def tenant_usage(self) -> list[tuple[str, TenantState]]:
        """The engine's and its fallback's usage, summed per tenant."""
        fallback = [self.fallback.tenant_usage()] if self.fallback is not None else []
        return merged_usage([self.main.tenant_usage(), *fallback])

    def submit(self, prompts: list[list[int]], params: SamplingParams | None = None, priority: int = 0,
               deadline: float | None = None, n: int = 1, tenant: Tenant = NO_TENANT,
               replayable: bool = False) -> list[FailoverRequest]:
        """As ``LLMEngine.submit``, on whichever engine serves now. ``replayable``: the caller shows the
        client nothing before the end (not streamed), so a fault at any point can restart it (each
        sample on its own, with its own params)."""
        params = params or SamplingParams()
        samples = [(p, params.for_sample(j)) for p in prompts for j in range(n)]
        for _ in range(2):  # the main engine may fail between the choice and the submit: then once more
            target = self._target()
            try:
                inner = target.submit(prompts, params, priority, deadline, n, tenant)
            except EngineStopped:
                if target is self.fallback or self.closing:
                    raise EngineUnavailable(retry_after_s=self.retry_after_s()) from None
                self.report(target, DIED)
                continue
            if target is self.fallback:
                self.fallback_requests += len(inner)
            return [FailoverRequest(self, p, sp, priority, deadline, r, target, replayable, tenant)
                    for (p, sp), r in zip(samples, inner, strict=True)]
        raise EngineUnavailable(retry_after_s=self.retry_after_s())

    def resubmit(self, req: FailoverRequest) -> tuple[GenerationStream, StaticFallback] | None:
        """The request's prompt on the fallback, and that fallback (None: no fallback, or it refused)."""
        fallback = self.fallback
        if fallback is None or not fallback.is_alive or self.closing:
            return None
        try:
            [inner] = fallback.submit([req.prompt], req.params, req.priority, req.deadline, 1, req.tenant)
        except Exception as exc:  # full or stopped: the client hears the main engine's failure
            log.warning("llm fallback refused a request moved from the failed engine: %r", exc)
            return None
        self.fallback_requests += 1
        return inner, fallback

    # -- faults -------------------------------------------------------------------------------------
    def report(self, engine: Engine, kind: str) -> None:
        """A fault of ``engine`` (counted once per engine): open the breaker and retire it."""
        with self._lock:
            main = self.main
            if engine is not main or self._main_failed or self.closing:
                return
            self._main_failed = True
            self.faults[kind] += 1
            self.breaker.record_failure(time.monotonic())
            self._retired.append(main)
        log.error("llm engine fault: %s; %s until a probe finds it healthy (next in %.1f s)", kind,
                  "the fallback engine serves" if self.fallback is not None else "requests get 503",
                  self.breaker.interval_s)
        main.retire()

    def _main_ok(self) -> bool:
        return self.breaker.allows and not self._main_failed and self.main.is_alive

    def _target(self) -> Engine:
        """The engine that serves now: the main one while healthy, else a live fallback, else none
        (``EngineUnavailable``)."""
        with self._lock:
            if self._main_ok():
                return self.main
        fallback = self.fallback
        if fallback is not None and fallback.is_alive:
            return fallback
        raise EngineUnavailable(retry_after_s=self.retry_after_s())

    # -- the watchdog thread ------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick(time.monotonic())
            except Exception:  # the watchdog must outlive whatever it watches
                log.exception("llm watchdog check failed")

    def _tick(self, now: float) -> None:
        with self._lock:
            main, failed = self.main, self._main_failed
        if not failed:
            kind = self.watchdog.check(main, now)
            if kind is not None and not self.closing:
                self.report(main, kind)
        if self.fallback is not None and not self.closing:
            self._watch_fallback(self.fallback, now)
        with self._lock:
            due = self.breaker.take_probe(now)
        if due:
            self._probe()

    def _watch_fallback(self, fallback: StaticFallback, now: float) -> None:
        """A fallback that died or stalls is abandoned (what it holds gets 503 ``engine_unavailable``)
        and, once its thread has ended, replaced by a new one on the same model."""
        if not self.fallback_failed:
            kind = self.fallback_watchdog.check(fallback, now)
            if kind is not None:
                self.fallback_failed = True
                self.fallback_faults[kind] += 1
                log.error("llm fallback fault: %s; its requests get 503 until it is rebuilt", kind)
                fallback.abandon()
        elif fallback.thread_ended:
            self.fallback, self.fallback_failed = fallback.restarted(), False
            log.info("llm fallback rebuilt after its fault")

    def _probe(self) -> None:
        with self._lock:
            self._retired = [e for e in self._retired if not e.thread_ended]
            busy = bool(self._retired)
        if busy:  # a step is still under way on the runner: no second thread may use it
            self._probe_failed(None, "the failed engine's step has not returned yet")
            return
        engine = self.main.rebuilt()
        ok = False
        try:
            timeout = self.watchdog.timeout_s()
            ok = asyncio.run(asyncio.wait_for(_one_token(engine), timeout))
        except Exception as exc:
            log.warning("llm engine probe failed: %r", exc)
        if not ok:
            self._probe_failed(engine, "the probe request failed")
            return
        with self._lock:
            if self.closing:  # shut down during the probe: nobody will stop this engine but us
                engine.shutdown(0.0)
                return
            self.main, self._main_failed = engine, False
            self.breaker.record_success(time.monotonic())
        log.info("llm engine probe succeeded: traffic returns to the continuous-batching engine")

    def _probe_failed(self, engine: LLMEngine | None, why: str) -> None:
        if engine is not None:
            engine.retire()
        with self._lock:
            if engine is not None:
                self._retired.append(engine)
            self.breaker.record_failure(time.monotonic())
        log.warning("llm engine probe: %s; next probe in %.1f s", why, self.breaker.interval_s)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the watchdog and every engine; what they still hold is answered ``EngineStopped``."""
        self.closing = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            retired = list(self._retired)
        for engine in retired:
            engine.shutdown(0.0)
        self.main.shutdown(timeout)
        if self.fallback is not None:
            self.fallback.shutdown(timeout)


async def _one_token(engine: LLMEngine) -> bool:
    bos = getattr(engine.tokenizer, "bos_token_id", None)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    [req] = engine.submit([[int(bos or 0)]], params, priority=-(2**31))
    try:
        async for out in req:
            if out.finish_reason is not None:
                return True
        return False
    finally:
        req.close()
