"""The live LLM driver: one engine thread loops ``schedule -> model step -> sample -> update``.

asyncio callers use ``generate(prompt, params) -> AsyncIterator[GenerationOutput]``; requests and
cancellations reach the thread through a queue, tokens come back with ``call_soon_threadsafe``.
Leaving the iterator early (client disconnect, ``break``, task cancelled) aborts the sequence and
frees its KV blocks. The thread owns the scheduler and the model: nothing else touches them, so the
pure core needs no locks. An exception in a step fails exactly the sequences of that step.

``build_llm_engine(model_path, **engine_config)`` assembles model, tokenizer, runner and scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..core.llm_scheduler import LLMScheduler, LLMSchedulerConfig, StepPlan
from ..core.request import IdCounter
from ..core.sequence import SamplingParams, Sequence
from ..models.llm.detokenizer import IncrementalDetokenizer, make_decode

log = logging.getLogger("batchpilot.llm")


class RequestRejected(ValueError):
    """The request can never run here (context length, KV pool, bad token ids); the message says why.
    ``code`` and ``param`` are for the OpenAI error body."""

    def __init__(self, message: str, code: str = "context_length_exceeded",
                 param: str = "max_tokens") -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class EngineStopped(RuntimeError):
    pass


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


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """For metrics observers: a token came out at ``t`` (engine clock, ``time.monotonic``)."""

    seq_id: int
    t: float
    ttft_s: float | None  # set on the first token
    itl_s: float | None  # set on later tokens
    finished: bool


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


class StepLog:
    """A step observer that appends one JSON line per step to ``path`` (``serve --llm-step-log``): what
    ``bench fidelity`` reads to compare the live server's steps with the step profile
    (``bench.llm_steps.speed_vs_profile``)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered (read while serving); close()
        self._lock = threading.Lock()

    def __call__(self, rec: StepRecord) -> None:
        line = json.dumps({"step": rec.step_id, "start": rec.start, "wall_s": rec.wall_s,
                           "forward_s": rec.forward_s, "seqs": rec.num_seqs, "after_idle": rec.after_idle,
                           "features": rec.features})
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


class _Stream:
    """Per-request state on the engine side: where to deliver, and its detokenizer (text, stops)."""

    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Any],
                 detok: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.loop = loop
        self.q = q
        self.detok = detok
        self.last_t: float | None = None

    def put(self, item: GenerationOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, item)


class LLMEngine:
    def __init__(self, runner: Any, tokenizer: Any, config: LLMSchedulerConfig,
                 model_name: str = "batchpilot-llm", sampler: Any | None = None,
                 window_s: float = 5.0) -> None:
        from ..models.llm.sampler import Sampler

        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self.scheduler = LLMScheduler(config)
        self.sampler = sampler or Sampler()
        self._ids = IdCounter()
        self._id_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.observers: list[Callable[[TokenEvent], None]] = []
        self.step_observers: list[Callable[[StepRecord], None]] = []  # called on the engine thread
        self.window_s = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self._last_forward_s = 0.0
        self._idled = True
        self.step_seqs = 0
        self.step_features: dict[str, float] = {}
        self._decode = make_decode(tokenizer)
        self._stats = self._snapshot()

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
            self._thread = None

    # -- public API --------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt, or the given ids checked against the vocabulary."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt)["input_ids"])
            if not ids:
                raise RequestRejected("the prompt encodes to no tokens; give a non-empty prompt",
                                      "invalid_value", "prompt")
            return ids
        ids = [int(t) for t in prompt]
        vocab = getattr(getattr(self.runner, "w", None), "vocab_size", None)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad or not ids:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab}); got {bad[:3] or 'no tokens'}",
                                  "invalid_value", "prompt")
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       priority: int = 0) -> AsyncIterator[GenerationOutput]:
        """Stream a completion. Raises ``RequestRejected`` before the first item if it can never fit."""
        if self._thread is None or self._stopping:
            raise EngineStopped("the LLM engine is not running")
        params = params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        with self._id_lock:
            seq_id = self._ids()
        seq = Sequence(seq_id, token_ids, params, arrival=time.monotonic(), priority=priority)
        reason = self.scheduler.check_fits(seq)  # pure and config-only: safe from this thread
        if reason is not None:
            raise RequestRejected(reason)
        q: asyncio.Queue[Any] = asyncio.Queue()
        detok = IncrementalDetokenizer(self._decode, params.stop)
        stream = _Stream(seq, asyncio.get_running_loop(), q, detok)
        self._inbox.put(("add", stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(seq_id)

    def abort(self, seq_id: int) -> None:
        self._inbox.put(("abort", seq_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    # -- engine thread -----------------------------------------------------------------------
    def _snapshot(self) -> EngineStats:
        s = self.scheduler
        b = s.block_stats()
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        recent = sum(n for _, n in self._recent)
        return EngineStats(s.num_running, s.num_waiting, b.num_blocks, b.num_free, b.usage, b.fragmentation,
                           s.num_preemptions, s.num_rejected, self.num_steps, self.num_generated_tokens,
                           recent / self.window_s, b.num_cache_hit_tokens, self.step_seconds,
                           self.forward_seconds, self.step_seqs, dict(self.step_features))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                reason = self.scheduler.add(arg.seq)
                if reason is not None:
                    arg.put(RequestRejected(reason))
                else:
                    self._streams[arg.seq.seq_id] = arg
            elif kind == "abort" and arg in self._streams:
                self.scheduler.abort(arg)
                self.sampler.forget(arg)
                del self._streams[arg]

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_unfinished():
                self._stats = self._snapshot()
                self._idled = True
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            try:
                self._step(plan)
            except Exception as exc:  # fail only this step's sequences; keep serving the rest
                log.exception("llm step %d failed", plan.step_id)
                for chunk in plan.chunks:
                    stream = self._streams.pop(chunk.seq_id, None)
                    self.scheduler.abort(chunk.seq_id)
                    self.sampler.forget(chunk.seq_id)
                    if stream is not None:
                        stream.put(RuntimeError(f"generation failed: {exc}"))
            self.num_steps += 1
            self.step_seqs += len(plan.chunks)
            feats = self.step_features
            shape = plan.shape.features()
            for name, value in shape.items():
                feats[name] = feats.get(name, 0.0) + value
            wall = time.perf_counter() - t0
            self.step_seconds += wall
            if self.step_observers:
                rec = StepRecord(plan.step_id, t0, wall, self._last_forward_s, len(plan.chunks), shape,
                                 self._idled)
                for step_obs in self.step_observers:
                    step_obs(rec)
            self._idled = False
            self._stats = self._snapshot()
        for stream in self._streams.values():
            stream.put(EngineStopped("the LLM engine shut down"))
        self._streams.clear()

    def _step(self, plan: StepPlan) -> None:
        self._last_forward_s = 0.0
        if plan.is_empty:
            return
        t0 = time.perf_counter()
        logits = self.runner.forward(plan.chunks)
        sampling = [c.seq_id for c in plan.chunks if c.sample]
        seqs = self.scheduler.seqs
        tokens = self.sampler.sample(logits, sampling, [seqs[i].params for i in sampling])
        self._last_forward_s = time.perf_counter() - t0
        self.forward_seconds += self._last_forward_s
        sampled = dict(zip(sampling, tokens, strict=True))
        stopped: set[int] = set()
        deltas: dict[int, str] = {}
        for sid, tok in sampled.items():
            stream = self._streams.get(sid)
            if stream is None:
                continue
            delta, hit = stream.detok.step(stream.seq.output_token_ids + [tok])
            deltas[sid] = delta
            if hit:
                stopped.add(sid)
        outputs = self.scheduler.update(plan, sampled, stopped)
        now = time.monotonic()
        self.num_generated_tokens += len(outputs)
        self._recent.append((now, len(outputs)))
        for out in outputs:
            stream = self._streams.get(out.seq_id)
            if stream is None:
                continue
            seq = stream.seq
            reason = None if out.finish_reason is None else out.finish_reason.value
            text = deltas.get(out.seq_id, "")
            if reason is not None and out.seq_id not in stopped:
                text += stream.detok.flush(seq.output_token_ids)
            stream.put(GenerationOutput(out.seq_id, text, [out.token_id], reason, seq.num_prompt_tokens,
                                        seq.num_output_tokens, seq.num_cached_tokens, seq.arrival, now))
            first = stream.last_t is None
            event = TokenEvent(out.seq_id, now, now - seq.arrival if first else None,
                               None if first else now - (stream.last_t or now), reason is not None)
            stream.last_t = now
            for obs in self.observers:
                obs(event)
            if reason is not None:
                del self._streams[out.seq_id]
                self.sampler.forget(out.seq_id)


_SCHED_FIELDS = {f.name for f in dataclasses.fields(LLMSchedulerConfig)}


def build_llm_engine(model_path: str | None = None, **engine_config: Any) -> LLMEngine:
    """Model, tokenizer, paged KV runner and scheduler, started and ready for ``generate``.

    ``engine_config`` keys: any ``LLMSchedulerConfig`` field (``max_num_seqs``,
    ``max_num_batched_tokens``, ``num_kv_blocks``, ``block_size``, ``max_model_len``, ``policy``,
    ``enable_chunked_prefill``, ``enable_prefix_caching``), any ``LLMModelConfig`` field for the
    random default model (``num_hidden_layers``, ``hidden_size``, ``seed``, ``initializer_range``, ...),
    and ``device`` ("cpu", "cuda"), ``dtype`` ("float32", "bfloat16", "float16"), ``model_name``,
    ``sampler_seed``, ``threads`` (torch intra-op threads, 0 = leave as is), ``start`` (default True).
    Unknown keys are errors.
    """
    import torch

    from ..models.llm.config import LLMModelConfig
    from ..models.llm.model_runner import LLMModelRunner
    from ..models.llm.sampler import Sampler
    from ..models.llm.tokenizer import load_tokenizer
    from ..models.llm.weights import LlamaWeights, load_hf_llama

    cfg = dict(engine_config)
    device = str(cfg.pop("device", "cpu"))
    dtype = getattr(torch, str(cfg.pop("dtype", "float32")))
    start = bool(cfg.pop("start", True))
    sampler_seed = int(cfg.pop("sampler_seed", 0))
    threads = int(cfg.pop("threads", 0))
    if threads:  # process-wide; 1 is steadier than torch's default when other jobs share the cores
        torch.set_num_threads(threads)
    model_fields = {f.name for f in dataclasses.fields(LLMModelConfig)}
    model_kw = {k: cfg.pop(k) for k in list(cfg) if k in model_fields}
    sched_kw = {k: cfg.pop(k) for k in list(cfg) if k in _SCHED_FIELDS}
    name = str(cfg.pop("model_name", model_path or "batchpilot-tiny-llama"))
    if cfg:
        raise ValueError(f"build_llm_engine: unknown option(s) {sorted(cfg)}; see the docstring for the keys")
    model_cfg = LLMModelConfig(**model_kw)
    if device == "cpu":
        from ..models.llm.model_runner import keep_freed_memory

        keep_freed_memory()
    hf = load_hf_llama(model_path, model_cfg, dtype=dtype)
    weights = LlamaWeights.from_hf(hf)
    tokenizer = load_tokenizer(model_path, model_cfg.vocab_size)
    del hf
    eos = set(weights.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    sched_kw.setdefault("max_model_len", weights.max_position_embeddings)
    sched_kw.setdefault("eos_token_ids", tuple(sorted(eos)))
    config = LLMSchedulerConfig(**sched_kw)
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size, device=device, dtype=dtype)
    engine = LLMEngine(runner, tokenizer, config, model_name=name, sampler=Sampler(sampler_seed))
    return engine.start() if start else engine
