"""The fallback LLM engine: static batches of HF ``generate`` on one thread, on the main engine's weights.

What serves completions while the continuous-batching engine cannot (``runtime/llm/failover.py``): no
paged KV cache, no scheduler, nothing shared with the failed engine but the weights (the HF model's
parameters are views of the runner's tensors, ``runtime.llm.build.share_runner_weights``: no second copy).
Admission is the main engine's (``core/llm/admission.py``: the same refusals and bound). Requests are
taken first come, first served, up to ``max_batch_size`` per batch; a batch is left-padded, run by
``model.generate`` to its longest ``max_tokens``, and the next waits for it to end.

Per request, inside the one ``generate`` call: tokens are chosen by the main engine's ``Sampler``
(greedy is argmax, so greedy output is token-identical to the main engine's; sampled rows use their
own seeded generators) through a logits processor that leaves HF only that token, and a stopping
criterion ends each row on EOS, a stop token id, a stop string (the same incremental detokenizer),
``max_tokens`` or the context length, on its deadline (``past_deadline``), or when its client leaves.
Streaming is one ``GenerationOutput`` per token, as the main engine streams. An ``Engine``
(``runtime/llm/engine.py``) as ``LLMEngine`` is, and for the failover's watchdog ``busy_since`` (when
the decoding step under way began), ``failure``, ``step_observers`` (a ``StepRecord`` per decoding
step), ``abandon`` and ``restarted``. A failing
``generate`` fails its batch (``GenerationFailed``) and the thread goes on. Refusals and deadline ends
are counted per request in ``admission.refused``, as the engine counts them (``llm_refusals``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from batchpilot.core.llm.admission import LLMAdmission, past_deadline
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.core.request import DEFAULT_TENANT, IdCounter
from batchpilot.core.tenants import TenantState, TenantTable
from batchpilot.models.device import bind_threads
from batchpilot.models.llm.sampler import Choice, Sampler
from batchpilot.models.llm.tokenizer import make_decode
from batchpilot.runtime.llm.engine import (
    NO_TENANT,
    EngineCounters,
    EngineStats,
    EngineStopped,
    GenerationFailed,
    GenerationOutput,
    LateRequests,
    LLMRequest,
    RequestTimedOut,
    StepRecord,
    Tenant,
    admit_requests,
    ask_room,
)

log = logging.getLogger("batchpilot.llm")


class StaticFallback:
    """The static-batching fallback engine (see the module docstring): an ``Engine``."""

    def __init__(self, model: Any, tokenizer: Any, config: LLMSchedulerConfig,
                 model_name: str = "batchpilot-llm", max_batch_size: int = 8,
                 sampler: Sampler | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"fallback max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.tokenizer = model, tokenizer
        model.generation_config.eos_token_id = None  # rows end by the rules below, never by HF's EOS
        self.config = config
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.threads: int | None = None  # CPU intra-op threads of its thread (the engine runner's)
        self.sampler = sampler or Sampler()
        self.sampler.bind(tokenizer, int(model.config.vocab_size), config.eos_token_ids)
        self.admission = LLMAdmission(config)  # the main engine's rules and bound, under ``_lock``
        self.tenant_label: Callable[[str], str] = str  # a tenant's metric label (``set_tenants``)
        self._decode = make_decode(tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad = int(pad if pad is not None else (config.eos_token_ids or (0,))[0])
        self._ids = IdCounter(1)
        self._lock = threading.Lock()
        self._late = LateRequests(self._lock)  # requests ended at their deadline
        self._inbox: queue.SimpleQueue[list[LLMRequest] | None] = queue.SimpleQueue()
        self._waiting: deque[LLMRequest] = deque()
        self._aborted: dict[int, float] = {}  # seq id -> when it was aborted
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self.max_admitted = self.admission.capacity
        self.num_batches = 0
        self.num_requests = 0  # sequences admitted
        self.busy_since: float | None = None  # the decoding step under way began (monotonic)
        self.failure: BaseException | None = None  # what ended the loop, if it died
        self.step_observers: list[Callable[[StepRecord], None]] = []
        self._batch: list[LLMRequest] = []  # the batch in ``generate``
        self._counters = EngineCounters()  # its decoding steps and tokens (fallback thread)
        self._stats = self._snapshot(time.monotonic())

    # -- lifecycle and admission (any thread / the event loop) -------------------------------------
    def start(self) -> StaticFallback:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llm-fallback", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and not self._stopping and not self._closed

    @property
    def thread_ended(self) -> bool:
        """Its thread has returned (or never started): a replacement may take the model."""
        return self._thread is None or not self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        """Sequences admitted and not yet done (what the queue bound counts)."""
        return self.admission.num_admitted

    def set_tenants(self, table: TenantTable, label: Callable[[str], str]) -> None:
        """As ``LLMEngine.set_tenants``."""
        with self._lock:
            self.admission.set_tenants(table, time.monotonic())
            self.tenant_label = label

    def tenant_usage(self) -> list[tuple[str, TenantState]]:
        """As ``LLMEngine.tenant_usage``."""
        with self._lock:
            return self.admission.usage()

    def check_room(self, n: int = 1, tenant: str = DEFAULT_TENANT) -> None:
        """As ``LLMEngine.check_room``: ``EngineStopped`` or ``EngineBusy`` (counted as a refusal)."""
        ask_room(self.admission, self._lock, self.is_alive, n, tenant)

    def stats(self) -> EngineStats:
        """A snapshot as ``LLMEngine.stats`` gives one, taken by its thread after each decoding step and
        batch and while idle: its batch and queue, decoding steps and tokens. No KV cache of its own
        (HF's, per batch): no blocks, preemptions or prefix-cache hits."""
        return self._stats

    def submit(self, prompts: list[list[int]], params: SamplingParams | None = None, priority: int = 0,
               deadline: float | None = None, n: int = 1, tenant: Tenant = NO_TENANT) -> list[LLMRequest]:
        """As ``LLMEngine.submit``: all the prompts together or none; call on the requests' event loop.
        A prompt's ``n`` samples are rows of their own (HF's cache shares nothing between rows)."""
        params = params or SamplingParams()
        loop, now = asyncio.get_running_loop(), time.monotonic()
        with self._lock:
            if self._closed or self._stopping:
                raise EngineStopped
            seqs = [Sequence(self._ids(), ids, params.for_sample(j), arrival=now, priority=priority,
                             deadline=deadline, tenant=tenant[0]) for ids in prompts for j in range(n)]
            reqs = admit_requests(self.admission, seqs, self._decode, params.stop, loop, self.abort,
                                  self._release)
            self.num_requests += len(reqs)
            self._inbox.put(reqs)
        return reqs

    def restarted(self) -> StaticFallback:
        """A new fallback on the same model and settings, with the same step observers (started)."""
        new = StaticFallback(self.model, self.tokenizer, self.config, self.model_name, self.max_batch_size,
                             Sampler(self.sampler.base_seed))
        new.step_observers = self.step_observers
        new.threads = self.threads
        new.admission.refused = self.admission.refused  # the refusal counts go on
        return new.start()

    def abandon(self) -> None:
        """Stop from any thread, even while ``generate`` is stuck: it admits nothing more, and every
        request it holds is answered ``EngineStopped`` now (a late duplicate reaches an ended request)."""
        with self._lock:
            self._closed = self._stopping = True
        pending = [*self._batch, *self._waiting]
        while True:
            try:
                pending.extend(self._inbox.get_nowait() or [])
            except queue.Empty:
                break
        self._inbox.put(None)
        for req in pending:
            req.put(EngineStopped())

    def abort(self, seq_id: int) -> None:
        with self._lock:
            self._aborted[seq_id] = time.monotonic()

    def _release(self, seq_id: int) -> None:  # a request's ``on_done``, on the caller's side
        with self._lock:
            self.admission.release(seq_id)

    # -- the fallback thread -----------------------------------------------------------------------
    def _snapshot(self, now: float) -> EngineStats:
        c, running = self._counters, len(self._batch)
        return EngineStats(running, max(0, self.num_pending - running), 0, 0, 0.0, 0.0, 0, 0, c.num_steps,
                           c.num_generated_tokens, c.tokens_per_s(now), 0, c.step_seconds, c.step_seconds,
                           c.step_seqs)

    def _loop(self) -> None:
        try:
            bind_threads(getattr(self.model, "device", None), self.threads)  # as the engine's thread does
            while not self._stopping:
                batch = self._next_batch()
                if batch:
                    self._run(batch)
                self._stats = self._snapshot(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - the requests must hear of it
            self.failure = exc
            log.exception("the LLM fallback loop died; failing every pending request")
        finally:
            with self._lock:
                self._closed = True
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._waiting.extend(item or [])
            for req in self._waiting:
                req.put(EngineStopped())

    def _next_batch(self) -> list[LLMRequest]:
        block = not self._waiting
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            self._waiting.extend(item)
            block = False
        batch: list[LLMRequest] = []
        while self._waiting and len(batch) < self.max_batch_size:
            req = self._waiting.popleft()
            if not self._ended(req, time.monotonic()):
                batch.append(req)
        return batch

    def _ended(self, req: LLMRequest, now: float) -> bool:
        """Aborted (nothing to say) or past its deadline (told so): either way, done here. Past its
        deadline it counts as a timeout, also when it was aborted past it (the routes' 504)."""
        with self._lock:
            aborted_at = self._aborted.pop(req.seq_id, None)
        late = past_deadline(req.seq, now if aborted_at is None else aborted_at)
        if late:
            self._late.count(req.seq, self.admission.refused)
        if aborted_at is None and late:
            req.put(RequestTimedOut())
        return aborted_at is not None or late

    def _run(self, batch: list[LLMRequest]) -> None:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        self.num_batches += 1
        width = max(r.seq.num_prompt_tokens for r in batch)
        ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's next token is at the same column
            ids[i, width - r.seq.num_prompt_tokens :] = torch.tensor(r.seq.prompt_token_ids)
            mask[i, width - r.seq.num_prompt_tokens :] = 1
        rows = _Rows(self, batch)
        longest = max(r.seq.params.max_tokens for r in batch)
        gen = GenerationConfig(max_new_tokens=longest, do_sample=False,  # type: ignore[no-untyped-call]
                               pad_token_id=self._pad, eos_token_id=None, bos_token_id=None)
        dev = self.model.device
        self._batch, self.busy_since = batch, time.monotonic()
        try:
            self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen,
                                logits_processor=LogitsProcessorList([rows.choose]),
                                stopping_criteria=StoppingCriteriaList([rows.deliver]))
        except Exception as exc:
            log.exception("llm fallback batch %d failed", self.num_batches)
            for i in rows.live():
                rows.end(i, GenerationFailed(cause=exc))
        finally:
            self._batch, self.busy_since = [], None
        for i in rows.live():  # generate ended early (shutdown): nothing more will come
            rows.end(i, EngineStopped())


class _Rows:
    """One batch's rows inside ``generate``: which are live, the token each takes, what each is told."""

    def __init__(self, owner: StaticFallback, batch: list[LLMRequest]) -> None:
        self.owner, self.batch = owner, batch
        self.done = [False] * len(batch)
        self.choices: dict[int, Choice] = {}  # row -> the choice ``choose`` made this decoding step

    def live(self) -> list[int]:
        return [i for i, d in enumerate(self.done) if not d]

    def end(self, i: int, item: BaseException | None = None) -> None:
        self.done[i] = True
        self.owner.sampler.forget(self.batch[i].seq_id)
        if item is not None:
            self.batch[i].put(item)

    def choose(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """A logits processor: each live row's token from the main engine's sampler, the pad for the rest."""
        live = self.live()
        picked = torch.full((scores.shape[0],), self.owner._pad, dtype=torch.long)
        if live:
            choices = self.owner.sampler.choose(scores[live].float(), [self.batch[i].seq for i in live])
            self.choices = dict(zip(live, choices, strict=True))
            picked[live] = torch.tensor([c.token for c in choices], dtype=torch.long)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(scores.shape[0]), picked.to(scores.device)] = 0.0
        return out

    def deliver(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        """A stopping criterion: hand each live row its new token and say which rows are done."""
        owner, now = self.owner, time.monotonic()
        cfg, began = owner.config, owner.busy_since or now
        owner.busy_since = now  # the next decoding step begins
        rec = StepRecord(owner.num_batches, began, now - began, now - began, len(self.live()), {}, False)
        for observe in owner.step_observers:
            observe(rec)
        owner._counters.add_step(rec.num_seqs, rec.features, rec.wall_s)
        last = input_ids[:, -1].tolist()
        delivered = 0
        for i in self.live():
            req, seq, tok = self.batch[i], self.batch[i].seq, int(last[i])
            if self.owner._stopping:
                self.end(i, EngineStopped())
                continue
            if self.owner._ended(req, now):
                self.end(i)
                continue
            seq.output_token_ids.append(tok)
            p = seq.params
            text, hit = req.detok.step(seq.output_token_ids)
            reason = None
            if seq.num_output_tokens > p.min_tokens and (
                    hit or tok in p.stop_token_ids or (not p.ignore_eos and tok in cfg.eos_token_ids)):
                reason = "stop"
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= cfg.max_model_len:
                reason = "length"
            if reason is not None and not hit:
                text += req.detok.flush(seq.output_token_ids)
            choice = self.choices.get(i, Choice(tok))
            req.put(GenerationOutput(seq.seq_id, text, [tok], reason, seq.num_prompt_tokens,
                                     seq.num_output_tokens, 0, seq.arrival, now, choice.logprob, choice.top))
            delivered += 1
            if reason is not None:
                self.end(i)
        owner._counters.add_tokens(now, delivered)
        owner._stats = owner._snapshot(now)
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)
