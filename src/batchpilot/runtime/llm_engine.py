"""The live LLM driver: one engine thread loops ``schedule -> model step -> sample -> update``.

asyncio callers ``submit`` token ids (all prompts of one request at once: admitted together or not at
all) and iterate the ``LLMRequest`` handles they get; ``generate`` wraps one prompt as an async
iterator. Requests and cancellations reach the thread through a queue, tokens come back with
``call_soon_threadsafe``. Closing a request early (client disconnect, ``break``, task cancelled)
aborts the sequence and frees its KV blocks; so does its deadline passing (``RequestTimedOut``:
``LLMScheduler.expire`` before each step).
The thread owns the scheduler and the model: nothing else touches them, so the pure core needs no locks.
A plan's KV block copies (swap preemption) run before its forward, priced at start-up for ``auto``
(``models/llm/profile.engine_preemption_costs``). Failures: an exception in a model step fails exactly
the sequences of that step (``GenerationFailed``; with those it swapped out when the copies failed);
one anywhere else in the loop (scheduling, an observer, the stats) ends the loop, and every request
still pending or running gets ``EngineStopped`` at once, as on shutdown. ``is_alive`` says which.
Admission is the core's (``core/llm_admission.py``): a request's prompts together or none, at most
``max_num_seqs + max_waiting_seqs`` sequences at a time (``EngineBusy``; ``RequestRejected`` never fits).
Refusals and deadline ends are counted per request, by reason, in ``counters.refused`` (``llm_refusals``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from batchpilot.core.llm_admission import LLMAdmission, past_deadline
from batchpilot.core.llm_scheduler import LLMScheduler, LLMSchedulerConfig, PreemptionCosts, StepPlan
from batchpilot.core.request import IdCounter
from batchpilot.core.sequence import SamplingParams, Sequence
from batchpilot.models.device import bind_threads
from batchpilot.models.llm.detokenizer import make_decode
from batchpilot.models.llm.profile import engine_preemption_costs
from batchpilot.runtime.llm_build import build_llm_engine
from batchpilot.runtime.llm_errors import (
    EngineBusy,
    EngineStopped,
    GenerationFailed,
    RequestRejected,
    RequestTimedOut,
)
from batchpilot.runtime.llm_prompts import PromptEncoder
from batchpilot.runtime.llm_records import (
    EngineStats,
    GenerationOutput,
    StepRecord,
    TokenEvent,
    token_records,
)
from batchpilot.runtime.llm_refusals import AdmissionFront, LateRequests, LLMCounters
from batchpilot.runtime.llm_request import LLMRequest, admit_requests
from batchpilot.runtime.llm_step_log import StepLog

__all__ = ["EngineBusy", "EngineStats", "EngineStopped", "GenerationFailed", "GenerationOutput", "LLMEngine",
           "LLMRequest", "RequestRejected", "RequestTimedOut", "StepLog", "StepRecord", "TokenEvent",
           "build_llm_engine"]

log = logging.getLogger("batchpilot.llm")


class LLMEngine(AdmissionFront):
    def __init__(self, runner: Any, tokenizer: Any, config: LLMSchedulerConfig,
                 model_name: str = "batchpilot-llm", sampler: Any | None = None,
                 window_s: float = 5.0, tokenizer_threads: int = 0,
                 preemption_costs: PreemptionCosts | None = None) -> None:
        from batchpilot.models.llm.sampler import Sampler

        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self.scheduler = LLMScheduler(config, engine_preemption_costs(runner, config, preemption_costs))
        self.sampler = sampler or Sampler()
        vocab = getattr(getattr(runner, "w", None), "vocab_size", None)
        self.prompts = PromptEncoder(tokenizer, vocab, tokenizer_threads)
        self._ids = IdCounter()
        self._lock = threading.Lock()  # ids, the admission count, and closing the inbox
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, LLMRequest] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # the loop has ended: nothing may enter the inbox
        self.failure: BaseException | None = None  # what ended the loop, if it died
        self.admission = LLMAdmission(config)  # sequences submitted and not yet done, under ``_lock``
        self.max_admitted = self.admission.capacity
        self.observers: list[Callable[[TokenEvent], None]] = []
        self.step_observers: list[Callable[[StepRecord], None]] = []  # called on the engine thread
        self.counters = LLMCounters(window_s)
        self._late = LateRequests(self._lock)  # engine thread: requests ended at their deadline
        self._last_forward_s = 0.0
        self._idled = True
        self.busy_since: float | None = None  # the step under way began (monotonic); None between steps
        self._decode = make_decode(tokenizer)
        self._stats = self._snapshot()

    @property
    def counters(self) -> LLMCounters:
        """Running totals; the admission counts its refusals into ``counters.refused``, so an engine
        given another's counters (``llm_failover.rebuild``) counts on from them."""
        return self._counters

    @counters.setter
    def counters(self, counters: LLMCounters) -> None:
        self._counters = counters
        self.admission.refused = counters.refused

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LLMEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; pending requests fail with ``EngineStopped``."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.prompts.close()

    @property
    def is_alive(self) -> bool:
        """The loop is running and taking requests (not stopped, not dead)."""
        t = self._thread
        return t is not None and t.is_alive() and not self._stopping and not self._closed

    # -- public API (``check_room``, ``num_pending``: ``AdmissionFront``) --------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams | None = None, priority: int = 0,
               deadline: float | None = None) -> list[LLMRequest]:
        """Admit the prompts together, or none of them: ``RequestRejected`` if one can never fit,
        ``EngineBusy`` if the queue bound would be passed, ``EngineStopped`` if the loop is not running.
        Call on the event loop the requests are iterated on. ``deadline`` is on ``time.monotonic``."""
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        with self._lock:
            if self._closed or self._stopping:
                raise EngineStopped
            seqs = [Sequence(self._ids(), ids, params, arrival=now, priority=priority, deadline=deadline)
                    for ids in prompts]
            reqs = admit_requests(self.admission, seqs, self._decode, params.stop, loop, self.abort,
                                  self._release)
            self._inbox.put(("add", reqs))
        self._wake.set()
        return reqs

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       priority: int = 0, deadline: float | None = None) -> AsyncIterator[GenerationOutput]:
        """Stream one completion (a text prompt is tokenised on this thread); raises what ``submit`` does."""
        [req] = self.submit([self.prompts.encode(prompt)], params, priority, deadline)
        try:
            async for item in req:
                yield item
        finally:
            req.close()

    def abort(self, seq_id: int) -> None:
        self._inbox.put(("abort", (seq_id, time.monotonic())))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    # -- engine thread -----------------------------------------------------------------------
    def _snapshot(self) -> EngineStats:
        return self.counters.snapshot(self.scheduler, time.monotonic())

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for req in arg:
                    reason = self.scheduler.add(req.seq)
                    if reason is not None:
                        req.put(RequestRejected(reason))
                    else:
                        self._streams[req.seq_id] = req
            elif kind == "abort" and arg[0] in self._streams:
                req = self._drop(arg[0])
                if req is not None and past_deadline(req.seq, arg[1]):  # aborted for it: the routes' 504
                    self._late.count(req.seq, self.counters.refused)

    def _drop(self, seq_id: int) -> LLMRequest | None:
        self.scheduler.abort(seq_id)
        self.sampler.forget(seq_id)
        return self._streams.pop(seq_id, None)

    def _expire(self) -> None:
        for seq in self.scheduler.expire(time.monotonic()):  # aborted, blocks freed, by the core's rule
            self.sampler.forget(seq.seq_id)
            req = self._streams.pop(seq.seq_id, None)
            if req is not None:
                self.counters.num_timed_out += 1
                self._late.count(seq, self.counters.refused)
                req.put(RequestTimedOut())

    def _loop(self) -> None:
        try:
            # this thread's own torch thread count, not what another model left (models.device.bind_threads)
            bind_threads(getattr(self.runner, "device", None), getattr(self.runner, "threads", None))
            while not self._stopping:
                self._iterate()
        except BaseException as exc:  # noqa: BLE001 - anything: the requests must hear of it
            self.failure = exc
            log.exception("the LLM engine loop died; failing every pending request")
        finally:
            self._fail_all()

    def _fail_all(self) -> None:
        with self._lock:
            self._closed = True  # from here on submit refuses: nothing can be left in the inbox
        pending = list(self._streams.values())
        self._streams.clear()
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                pending.extend(arg)
        for req in pending:
            req.put(EngineStopped())
        self._stats = self._snapshot()

    def _iterate(self) -> None:
        self._drain_inbox()
        self._expire()
        if not self.scheduler.has_unfinished():
            self._stats = self._snapshot()
            self._idled = True
            self._wake.wait(0.5)
            self._wake.clear()
            return
        t0, self.busy_since = time.perf_counter(), time.monotonic()
        plan = self.scheduler.schedule(self.busy_since)  # the clock of Sequence.arrival (submit)
        copied = False
        try:
            if plan.swap_out or plan.swap_in:  # before the forward, which may overwrite swapped-out blocks
                t_swap = time.perf_counter()
                self.runner.swap(plan.swap_out, plan.swap_in)
                self.counters.swap_seconds += time.perf_counter() - t_swap
            copied = True
            self._step(plan)
        except Exception as exc:  # fail this step's sequences (and those whose KV missed the host)
            log.exception("llm step %d failed", plan.step_id)
            for seq_id in [c.seq_id for c in plan.chunks] + ([] if copied else plan.swapped_out):
                req = self._drop(seq_id)
                if req is not None:
                    req.put(GenerationFailed(cause=exc))
        shape = plan.shape.features()
        wall = time.perf_counter() - t0
        self.counters.add_step(len(plan.chunks), shape, wall)
        if self.step_observers:
            rec = StepRecord(plan.step_id, t0, wall, self._last_forward_s, len(plan.chunks), shape,
                             self._idled)
            for step_obs in self.step_observers:
                step_obs(rec)
        self._idled, self.busy_since = False, None
        self._stats = self._snapshot()

    def _step(self, plan: StepPlan) -> None:
        self._last_forward_s = 0.0
        if not plan.chunks:
            return
        t0 = time.perf_counter()
        logits = self.runner.forward(plan.chunks)
        sampling = [c.seq_id for c in plan.chunks if c.sample]
        seqs = self.scheduler.seqs
        tokens = self.sampler.sample(logits, sampling, [seqs[i].params for i in sampling])
        self._last_forward_s = time.perf_counter() - t0
        self.counters.forward_seconds += self._last_forward_s
        sampled = dict(zip(sampling, tokens, strict=True))
        stopped: set[int] = set()
        deltas: dict[int, str] = {}
        for sid, tok in sampled.items():
            req = self._streams.get(sid)
            if req is None:
                continue
            delta, hit = req.detok.step(req.seq.output_token_ids + [tok])
            deltas[sid] = delta
            if hit:
                stopped.add(sid)
        outputs = self.scheduler.update(plan, sampled, stopped)
        now = time.monotonic()
        self.counters.add_tokens(now, len(outputs))
        for out in outputs:
            req = self._streams.get(out.seq_id)
            if req is None:
                continue
            seq = req.seq
            reason = None if out.finish_reason is None else out.finish_reason.value
            text = deltas.get(out.seq_id, "")
            if reason is not None and out.seq_id not in stopped:
                text += req.detok.flush(seq.output_token_ids)
            output, event = token_records(seq, out.token_id, reason, text, now, req.last_t)
            req.put(output)
            req.last_t = now
            for obs in self.observers:
                obs(event)
            if reason is not None:
                del self._streams[out.seq_id]
                self.sampler.forget(out.seq_id)
