"""The continuous-batching LLM engine: one engine thread loops ``schedule -> model step -> sample -> update``.

asyncio callers ``submit`` token ids (all prompts of one request at once: admitted together or not at
all) and iterate the ``LLMRequest`` handles they get; ``generate`` wraps one prompt as an async
iterator. Requests and cancellations reach the thread through a queue, tokens come back with
``call_soon_threadsafe``. Closing a request early (client disconnect, ``break``, task cancelled)
aborts the sequence and frees its KV blocks; so does its deadline passing (``RequestTimedOut``:
``LLMScheduler.expire`` before each step).
The thread owns the scheduler and the model: nothing else touches them, so the pure core needs no locks.
A plan's KV block copies (swap preemption) run before its forward, priced at start-up for ``auto``
(``models/llm/runner.engine_preemption_costs``). Failures: an exception in a model step fails exactly
the sequences of that step (``GenerationFailed``; with those it swapped out when the copies failed);
one anywhere else in the loop (scheduling, an observer, the stats) ends the loop, and every request
still pending or running gets ``EngineStopped`` at once, as on shutdown. ``is_alive`` says which.
Admission is the core's (``core/llm/admission.py``): a request's prompts together or none, at most
``max_num_seqs + max_waiting_seqs`` sequences at a time (``EngineBusy``; ``RequestRejected`` never fits).
Refusals and deadline ends are counted per request, by reason, in ``counters.refused``.

Beside the engine, in this order, what its callers meet: the errors a request can end with, what the
engine hands out (outputs, observer events, stats), the request handle, the refusal counts, the prompt
encoder, the ``Engine`` protocol that this engine, the static fallback (``runtime/llm/fallback.py``)
and the failover (``runtime/llm/failover.py``) share, and the step log of ``serve --llm-step-log``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Items
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from batchpilot.core.deployment import LLMDeployment
from batchpilot.core.llm.admission import (
    NEVER_FITS,
    QUEUE_FULL,
    QUOTA_CONCURRENCY,
    QUOTA_TOKENS,
    TIMEOUT,
    LLMAdmission,
    LLMRefusal,
    past_deadline,
)
from batchpilot.core.llm.config import KVPlan, LLMSchedulerConfig, MemoryProfile
from batchpilot.core.llm.scheduler import LLMScheduler, PreemptionCosts, StepPlan
from batchpilot.core.llm.sequence import SamplingParams, Sequence, StructuredOutput
from batchpilot.core.request import DEFAULT_TENANT, IdCounter
from batchpilot.core.tenants import TenantState, TenantTable
from batchpilot.models.device import bind_threads
from batchpilot.models.llm.grammar import GrammarRefused, grammars_for
from batchpilot.models.llm.runner import engine_preemption_costs
from batchpilot.models.llm.sampler import Choice
from batchpilot.models.llm.tokenizer import IncrementalDetokenizer, chat_prompt_ids, make_decode
from batchpilot.runtime.journal import JsonLines

log = logging.getLogger("batchpilot.llm")


# -- Errors ------------------------------------------------------------------------------------------
# Why an LLM request did not (or will not) finish normally. Each has a stable ``code``; the HTTP layer
# answers with a fixed message per code, and only ``RequestRejected`` carries a message meant for the
# client (what the request asked for and what this engine allows). ``refused`` turns the core's
# admission refusal (``core/llm/admission.py``) into the error the engine raises.

class RequestRejected(ValueError):
    """The request can never run here (context length, KV pool, bad token ids); the message says why.
    ``code`` and ``param`` are for the OpenAI error body."""

    def __init__(self, message: str, code: str = "context_length_exceeded",
                 param: str | None = "max_tokens") -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class EngineStopped(RuntimeError):
    """The engine is not running (shut down, or its loop died): nothing more will be generated."""

    code = "engine_stopped"

    def __init__(self, message: str = "the LLM engine is not running") -> None:
        super().__init__(message)


class EngineBusy(RuntimeError):
    """The engine holds as many sequences as it may queue: retry later."""

    code = "queue_full"

    def __init__(self, message: str = "the LLM engine's queue is full", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverQuota(RuntimeError):
    """The request's tenant is over a quota (``code``: ``quota_tokens`` or ``quota_concurrency``): retry
    after ``retry_after_s``, or never (None: more tokens than the tenant's burst)."""

    def __init__(self, message: str, code: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class RequestTimedOut(TimeoutError):
    """The sequence passed its deadline; the engine aborted it and freed its KV blocks."""

    code = "timeout"

    def __init__(self, message: str = "the request passed its deadline") -> None:
        super().__init__(message)


class EngineUnavailable(EngineStopped):
    """The engine failed (died, stalled, ran out of memory) and no fallback can take the request; a
    probe of the engine may bring it back (``runtime/llm/failover.py``): retry after ``retry_after_s``."""

    code = "engine_unavailable"

    def __init__(self, message: str = "the LLM engine is unavailable", retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GenerationFailed(RuntimeError):
    """A model step failed for this sequence; the exception itself is in the engine's log, and in
    ``cause`` for the failover to read (never for the client)."""

    code = "generation_failed"

    def __init__(self, message: str = "generation failed", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def out_of_memory(self) -> bool:
        """The step ran out of memory (``torch.OutOfMemoryError`` or a RuntimeError saying so)."""
        return is_out_of_memory(self.cause)


def is_out_of_memory(exc: BaseException | None) -> bool:
    """An out-of-memory error of torch (CUDA, MPS, CPU allocator) or of Python itself."""
    if exc is None:
        return False
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def refused(refusal: LLMRefusal) -> RequestRejected | OverQuota | EngineBusy:
    """The core's refusal as the engine's error: never fits -> ``RequestRejected`` (400, its message
    passed on), over a tenant's quota -> ``OverQuota`` (429), a full engine -> ``EngineBusy`` (503 +
    Retry-After)."""
    if refusal.reason == NEVER_FITS:
        return RequestRejected(refusal.message)
    if refusal.reason in (QUOTA_TOKENS, QUOTA_CONCURRENCY):
        return OverQuota(refusal.message, refusal.reason, refusal.retry_after_s)
    return EngineBusy(refusal.message, refusal.retry_after_s or 1.0)


def ask_room(admission: LLMAdmission, lock: threading.Lock, alive: bool, n: int, tenant: str) -> None:
    """The room check the engine and the static fallback both make: ``EngineStopped`` unless ``alive``,
    else the core's answer to ``n`` more sequences of ``tenant`` (``LLMAdmission.ask``, under the
    engine's lock), a refusal raised as the engine's error."""
    if not alive:
        raise EngineStopped
    with lock:
        refusal = admission.ask(n, tenant, time.monotonic())
    if refusal is not None:
        raise refused(refusal)


# -- What the engine hands out ---------------------------------------------------------------------
# Streamed outputs, token and step events for observers, and its stats.

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
    # the token's log-probability and the most likely alternatives (id, logprob), when the params ask
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """For metrics observers: a token came out at ``t`` (engine clock, ``time.monotonic``)."""

    seq_id: int
    t: float
    ttft_s: float | None  # set on the first token
    itl_s: float | None  # set on later tokens
    finished: bool
    tenant: str = DEFAULT_TENANT


def token_records(seq: Sequence, choice: Choice, finish_reason: str | None, text: str, now: float,
                  last_t: float | None) -> tuple[GenerationOutput, TokenEvent]:
    """One token of ``seq`` leaving its step at ``now``: the stream's increment and the observers' event
    (TTFT when ``last_t``, the previous token's time, is None; else the gap since it)."""
    output = GenerationOutput(seq.seq_id, text, [choice.token], finish_reason, seq.num_prompt_tokens,
                              seq.num_output_tokens, seq.num_cached_tokens, seq.arrival, now,
                              choice.logprob, choice.top)
    first = last_t is None
    event = TokenEvent(seq.seq_id, now, now - seq.arrival if first else None,
                       None if first else now - (last_t or now), finish_reason is not None, seq.tenant)
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
    # under ``policy: fair``: each tenant's counter and waiting sequences (``FairWaiting.usage``)
    tenant_counters: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)


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
    recent_tokens: int = 0  # the sum over ``recent`` (a snapshot per step must not add the window up)

    def add_tokens(self, now: float, n: int) -> None:
        self.num_generated_tokens += n
        self.recent.append((now, n))
        self.recent_tokens += n

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
            num_blocks_swapped_in=p.num_blocks_swapped_in, swap_seconds=self.swap_seconds,
            tenant_counters={} if s.fair is None else s.fair.usage())

    def tokens_per_s(self, now: float) -> float:
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent_tokens -= self.recent.popleft()[1]
        return self.recent_tokens / self.window_s



# -- The request handle ----------------------------------------------------------------------------

class LLMRequest:
    """One request's sequence as both sides of the engine see it.

    The engine thread delivers outputs (or the exception that ends the sequence) with ``put``; the
    asyncio caller iterates the request. ``close()`` ends it from the caller's side: a sequence not yet
    finished is aborted and its KV blocks freed. Either way ``on_done`` runs once, on the caller's side,
    when the request stops counting against the engine's queue bound."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[int], None], on_done: Callable[[int], None]) -> None:
        self.seq = seq
        self.detok = detok
        self.last_t: float | None = None  # engine side: when its last token left a step
        self._loop = loop
        self._q: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        self._abort = abort
        self._on_done = on_done
        self._ended = False  # the engine will deliver nothing more
        self._released = False

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def deadline(self) -> float | None:
        """The sequence's deadline (engine clock, ``time.monotonic``; None: none)."""
        return self.seq.deadline

    # -- engine thread -----------------------------------------------------------------------
    def put(self, item: GenerationOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)

    # -- caller (event loop) -----------------------------------------------------------------
    def __aiter__(self) -> LLMRequest:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finish_reason is not None:
            self._end()
        return item

    def close(self) -> None:
        """Stop caring about the answer: abort the sequence unless it has finished. Idempotent."""
        if not self._ended:
            self._abort(self.seq.seq_id)
        self._end()

    def _end(self) -> None:
        self._ended = True
        if not self._released:
            self._released = True
            self._on_done(self.seq.seq_id)


def admit_requests(admission: LLMAdmission, seqs: list[Sequence], decode: Callable[[Items[int]], str],
                   stop: Items[str], loop: asyncio.AbstractEventLoop,
                   abort: Callable[[int], None], on_done: Callable[[int], None]) -> list[LLMRequest]:
    """The handles of one request's sequences, once the core admits them together (``admission.admit``);
    a refusal raises its error (``server.llm.routes.refused``). The engine and the static fallback both
    call it,
    under their own lock."""
    refusal = admission.admit(seqs, time.monotonic())
    if refusal is not None:
        raise refused(refusal)
    return [LLMRequest(seq, IncrementalDetokenizer(decode, stop), loop, abort, on_done) for seq in seqs]


# -- Refusal counts --------------------------------------------------------------------------------
# What an LLM engine refused, by reason: the counts ``batchpilot_llm_rejected_requests{reason}`` reads.
#
# The reasons are the error codes of the answers (``core/llm/admission.py``), one count per request:
#
# * ``context_length_exceeded`` (400) and ``queue_full`` (503): the core's admission refusals,
#   ``LLMAdmission.refused``. ``admit`` counts them, and so does ``ask`` for a full engine found by
#   ``check_room`` (the routes ask before tokenising): each refused request counts once.
# * ``timeout`` (504, or the timeout error event of a stream already under way): a request whose
#   sequences the engine ended at their deadline (``past_deadline``): expired by the engine
#   (``LLMScheduler.expire``; the static fallback by the same test), or aborted by the routes once it
#   had passed.
#
# The engine's counts live in ``LLMCounters.refused``, the ``Counter`` its admission counts into: an
# engine rebuilt on another's counters (``LLMEngine.rebuilt``) counts on from them. The static
# fallback counts in its admission's, which ``restarted`` hands on.

REASONS = (NEVER_FITS, QUOTA_TOKENS, QUOTA_CONCURRENCY, QUEUE_FULL, TIMEOUT)


@dataclasses.dataclass
class LLMCounters(EngineCounters):
    """The engine's running totals, with the requests it refused by reason (``REASONS``)."""

    refused: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class LateRequests:
    """Counts each request that ended at its deadline once, however many of its sequences end there.

    The sequences of one request share their ``arrival`` and ``deadline`` (one ``submit``), so that pair
    names the request; the last ``keep`` requests counted are remembered (the sequences of one request
    reach their end within a step or a batch of each other)."""

    def __init__(self, lock: threading.Lock, keep: int = 1024) -> None:
        self._lock = lock  # the lock the admission counts under
        self._keep = keep
        self._seen: dict[tuple[float, float | None], None] = {}

    def count(self, seq: Sequence, refused: collections.Counter[str]) -> None:
        """``seq`` ended at its deadline: count its request under ``TIMEOUT`` unless it is counted."""
        key = (seq.arrival, seq.deadline)
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > self._keep:
            del self._seen[next(iter(self._seen))]
        with self._lock:
            refused[TIMEOUT] += 1



# -- Prompt encoding -------------------------------------------------------------------------------

class PromptEncoder:
    """Prompts to token ids, in a small thread pool so that a long prompt or a chat template never holds
    the event loop (health checks and every stream keep going while it runs).

    Each worker thread uses its own copy of the tokenizer: HF fast tokenizers are not safe to share
    between threads (a call that changes truncation or padding borrows the Rust object mutably). A prompt
    the tokenizer or template cannot take (a lone surrogate, roles out of order) is a ``RequestRejected``
    with a fixed message; the tokenizer's own text goes to the log only."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, threads: int = 0,
                 eos_ids: Items[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.threads = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="batchpilot-llm-tokenize")
        self._local = threading.local()

    # -- on any thread, with a given tokenizer -----------------------------------------------
    def encode(self, prompt: str | list[int], tokenizer: Any = None) -> list[int]:
        """Token ids of a text prompt, or the given ids checked against the vocabulary."""
        if isinstance(prompt, str):
            try:
                ids = list((tokenizer or self.tokenizer)(prompt)["input_ids"])
            except Exception as exc:
                log.info("prompt not tokenisable: %r", exc)
                raise RequestRejected("the prompt could not be tokenised (is it valid Unicode text?)",
                                      "invalid_value", "prompt") from None
            if not ids:
                raise RequestRejected("the prompt encodes to no tokens; give a non-empty prompt",
                                      "invalid_value", "prompt")
            return ids
        vocab = self.vocab_size
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)][:3]
        if bad or not prompt:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab}); got {bad or 'no tokens'}",
                                  "invalid_value", "prompt")
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict[str, str]], tokenizer: Any = None) -> list[int]:
        tok = tokenizer or self.tokenizer
        try:
            ids = chat_prompt_ids(tok, messages)  # the checkpoint's template, else the built-in format
        except Exception as exc:  # a template that refuses the conversation (e.g. role order), bad text
            log.info("chat template failed: %r", exc)
            raise RequestRejected("the chat template could not render these messages (check the order "
                                  "of roles and that the text is valid Unicode)", "invalid_value",
                                  "messages") from None
        if not ids:
            raise RequestRejected("the messages encode to no tokens", "invalid_value", "messages")
        return ids

    def check_constraint(self, constraint: StructuredOutput, param: str = "response_format") -> None:
        """Compile a structured-output constraint (cached for the engine's sampler), or refuse it with the
        grammar library's reason."""
        vocab = self.vocab_size or len(self.tokenizer)
        try:
            grammars_for(self.tokenizer, vocab, self.eos_ids).compile(constraint)
        except GrammarRefused as exc:
            raise RequestRejected(f"{param} cannot be served: {exc}", "invalid_value", param) from None

    # -- off the event loop ------------------------------------------------------------------
    async def check_constraint_async(self, constraint: StructuredOutput, param: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self.check_constraint, constraint, param)

    async def encode_async(self, prompt: str | list[int]) -> list[int]:
        return await self._run(self.encode, prompt)

    async def encode_chat_async(self, messages: list[dict[str, str]]) -> list[int]:
        return await self._run(self.encode_chat, messages)

    async def _run(self, fn: Any, arg: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(arg, self._thread_tokenizer()))

    def _thread_tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- The protocol the engines share ---------------------------------------------------------------

Tenant = tuple[str, float]  # who a request is for, and that tenant's weight under the fair order
NO_TENANT: Tenant = (DEFAULT_TENANT, 1.0)


class GenerationStream(Protocol):
    """One sequence's outputs as its caller iterates them: an ``LLMRequest``, or the failover's
    ``FailoverRequest`` over one. ``close()`` stops caring about the rest (idempotent)."""

    @property
    def seq_id(self) -> int: ...

    def __aiter__(self) -> GenerationStream: ...

    async def __anext__(self) -> GenerationOutput: ...

    def close(self) -> None: ...


class Engine(Protocol):
    """What serves LLM requests, as the routes, the metrics and the failover call it: this module's
    ``LLMEngine``, the ``StaticFallback`` (``runtime/llm/fallback.py``) and the ``LLMFailover`` in front
    of both (``runtime/llm/failover.py``). ``submit`` admits every prompt of one request or none
    (``RequestRejected``, ``EngineBusy``, ``EngineStopped``), ``n`` samples of each in prompt order;
    ``check_room`` asks first, before the caller spends time tokenising; ``deadline`` is on
    ``time.monotonic``."""

    @property
    def is_alive(self) -> bool: ...

    @property
    def num_pending(self) -> int: ...

    def check_room(self, n: int = 1, tenant: str = DEFAULT_TENANT) -> None: ...

    def submit(self, prompts: list[list[int]], params: SamplingParams | None = None, priority: int = 0,
               deadline: float | None = None, n: int = 1, tenant: Tenant = NO_TENANT
               ) -> Items[GenerationStream]: ...

    def stats(self) -> EngineStats: ...

    def set_tenants(self, table: TenantTable, label: Callable[[str], str]) -> None: ...

    def tenant_usage(self) -> list[tuple[str, TenantState]]: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


# -- The engine -------------------------------------------------------------------------------------


class LLMEngine:
    """The continuous-batching engine (see the module docstring): an ``Engine``."""

    def __init__(self, runner: Any, tokenizer: Any, config: LLMSchedulerConfig,
                 model_name: str = "batchpilot-llm", sampler: Any | None = None,
                 window_s: float = 5.0, tokenizer_threads: int = 0,
                 preemption_costs: PreemptionCosts | None = None) -> None:
        from batchpilot.models.llm.sampler import Sampler

        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self._weights: dict[str, float] = {}  # each tenant's weight, as its last request gave it
        self.scheduler = LLMScheduler(config, engine_preemption_costs(runner, config, preemption_costs),
                                      weight_of=lambda t: self._weights.get(t, 1.0))
        self.sampler = sampler or Sampler()
        vocab = getattr(getattr(runner, "w", None), "vocab_size", None)
        self.sampler.bind(tokenizer, vocab or len(tokenizer), config.eos_token_ids)
        self.prompts = PromptEncoder(tokenizer, vocab, tokenizer_threads, config.eos_token_ids)
        self._ids = IdCounter()
        self._lock = threading.Lock()  # ids, the admission count, and closing the inbox
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, LLMRequest] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # the loop has ended: nothing may enter the inbox
        self.failure: BaseException | None = None  # what ended the loop, if it died
        # sequences submitted and not yet done, under ``_lock``; shared by weight under policy fair
        self.admission = LLMAdmission(config, lambda t: self._weights.get(t, 1.0))
        self.tenant_label: Callable[[str], str] = str  # a tenant's metric label (``set_tenants``)
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
        # what the builder (runtime/llm/build.py) planned and made beside the engine: /metrics reads the
        # memory, the failover's fallback runs on ``hf_model`` (the HF module over the runner's tensors)
        self.deployment: LLMDeployment | None = None
        self.memory_plan: KVPlan | None = None
        self.memory_profile: MemoryProfile | None = None
        self.memory_held_before = 0.0  # the process's memory before the model loaded (CPU: built_overhead)
        self.hf_model: Any = None

    @property
    def counters(self) -> LLMCounters:
        """Running totals; the admission counts its refusals into ``counters.refused``, so an engine
        given another's counters (``rebuilt``) counts on from them."""
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

    @property
    def thread_ended(self) -> bool:
        """Its thread has returned (or never started): nothing of this engine runs on the runner."""
        return self._thread is None or not self._thread.is_alive()

    def retire(self) -> None:
        """Stop from any thread, even one stuck in a step: it admits nothing more, and every request it
        holds or has queued is answered ``EngineStopped`` now (what its own loop does on the way out,
        done from outside; a late duplicate reaches a request that has already ended, unread). Its
        tokenising pool stays open: the failover shares it with the next engine (``rebuilt``)."""
        with self._lock:
            self._closed = True
            self._stopping = True
        self._wake.set()
        for req in [*self._streams.values(), *self._queued()]:
            req.put(EngineStopped())

    def rebuilt(self) -> LLMEngine:
        """A new engine on this one's runner, tokenizer, config, prompt encoder, counters, observers and
        memory plan (the same runner, the same plan), with a fresh scheduler and sampler (started): the
        failover's probe after a fault. This engine's thread must have ended (``thread_ended``): two
        threads never share the runner."""
        from batchpilot.models.llm.sampler import Sampler

        engine = LLMEngine(self.runner, self.tokenizer, self.config, self.model_name,
                           Sampler(getattr(self.sampler, "base_seed", 0)), tokenizer_threads=1)
        engine.prompts.close()
        engine.prompts = self.prompts
        engine.counters = self.counters
        engine.observers, engine.step_observers = self.observers, self.step_observers
        engine.hf_model = self.hf_model
        engine.memory_plan, engine.memory_profile = self.memory_plan, self.memory_profile
        engine.memory_held_before = self.memory_held_before
        engine.admission.tenants, engine.tenant_label = self.admission.tenants, self.tenant_label
        return engine.start()

    @property
    def num_pending(self) -> int:
        """Sequences admitted and not yet done (what the queue bound counts)."""
        return self.admission.num_admitted

    # -- public API --------------------------------------------------------------------------
    def set_tenants(self, table: TenantTable, label: Callable[[str], str]) -> None:
        """The keys file's tenants (their quotas, ``LLMAdmission.set_tenants``), and each tenant's
        bounded metric label."""
        with self._lock:
            self.admission.set_tenants(table, time.monotonic())
            self.tenant_label = label

    def tenant_usage(self) -> list[tuple[str, TenantState]]:
        """Every tenant the admission tracks, by name (a snapshot)."""
        with self._lock:
            return self.admission.usage()

    def check_room(self, n: int = 1, tenant: str = DEFAULT_TENANT) -> None:
        """Raise ``EngineStopped`` or ``EngineBusy`` if ``n`` more sequences of ``tenant`` would be
        refused now: the cheap check a server makes before it spends time tokenising them (counted as a
        refusal: ``LLMAdmission.ask``)."""
        ask_room(self.admission, self._lock, self.is_alive, n, tenant)

    def submit(self, prompts: list[list[int]], params: SamplingParams | None = None, priority: int = 0,
               deadline: float | None = None, n: int = 1, tenant: Tenant = NO_TENANT) -> list[LLMRequest]:
        """Admit the prompts together, or none of them: ``RequestRejected`` if one can never fit,
        ``EngineBusy`` if the queue bound would be passed, ``EngineStopped`` if the loop is not running.
        Call on the event loop the requests are iterated on. ``deadline`` is on ``time.monotonic``.
        ``n`` samples of each prompt (``SamplingParams.for_sample``), in prompt order; the samples of one
        prompt are a group that shares its KV blocks (``core/llm/scheduler.py``). ``tenant``: who they
        are for and that tenant's weight (the fair order's, ``core/llm/fair.py``)."""
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        with self._lock:
            if self._closed or self._stopping:
                raise EngineStopped
            self._weights[tenant[0]] = tenant[1]  # the engine thread's weight_of reads the latest
            seqs = []
            for ids in prompts:
                first = self._ids()
                seqs += [Sequence(first if j == 0 else self._ids(), ids, params.for_sample(j), arrival=now,
                                  priority=priority, deadline=deadline, group=first if n > 1 else None,
                                  tenant=tenant[0]) for j in range(n)]
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

    def _release(self, seq_id: int) -> None:  # a request's ``on_done``, on the caller's side
        with self._lock:
            self.admission.release(seq_id)

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
        pending = [*self._streams.values(), *self._queued()]
        self._streams.clear()
        for req in pending:
            req.put(EngineStopped())
        self._stats = self._snapshot()

    def _queued(self) -> list[LLMRequest]:
        """Take the requests still in the inbox, not yet the engine thread's (call once ``_closed``)."""
        queued: list[LLMRequest] = []
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return queued
            if kind == "add":
                queued.extend(arg)

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
        sampling = [self.scheduler.seqs[c.seq_id] for c in plan.chunks if c.sample]
        logits = self.runner.forward(plan.chunks)
        choices = dict(zip([s.seq_id for s in sampling], self.sampler.choose(logits, sampling), strict=True))
        self._last_forward_s = time.perf_counter() - t0
        self.counters.forward_seconds += self._last_forward_s
        sampled = {sid: c.token for sid, c in choices.items()}
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
            output, event = token_records(seq, choices[out.seq_id], reason, text, now, req.last_t)
            req.put(output)
            req.last_t = now
            for obs in self.observers:
                obs(event)
            if reason is not None:
                del self._streams[out.seq_id]
                self.sampler.forget(out.seq_id)


# -- Step log --------------------------------------------------------------------------------------
# ``serve --llm-step-log``: a step observer that appends one JSON line per engine step to a file.
#
# The engine thread only queues the step's record; a writer thread formats and writes the lines
# (``journal.JsonLines``: a write on the engine thread would slow the steps it logs).

def step_line(rec: StepRecord) -> dict[str, Any]:
    """One step's line: what ``bench.llm_fidelity.read_steps`` reads back."""
    return {"step": rec.step_id, "start": rec.start, "wall_s": rec.wall_s, "forward_s": rec.forward_s,
            "seqs": rec.num_seqs, "after_idle": rec.after_idle, "features": rec.features}


class StepLog:
    """A step observer that appends one JSON line per step to ``path`` (``serve --llm-step-log``): what
    ``bench fidelity`` reads to compare the live server's steps with the step profile
    (``bench.llm_fidelity.speed_vs_profile``). Lines are written by a thread of their own, within
    ``journal.FLUSH_S`` of their step; ``flush()`` writes them now, ``close()`` writes and closes."""

    def __init__(self, path: str) -> None:
        self._lines = JsonLines(path, step_line, name="llm-step-log")

    def __call__(self, rec: StepRecord) -> None:
        self._lines.append(rec)

    def flush(self) -> None:
        self._lines.flush()

    def close(self) -> None:
        self._lines.close()
