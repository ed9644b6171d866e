"""The embeddings request path: validate, tokenise (a thread pool, off the event loop), admit through
the core, wait, answer.

    POST /v1/embeddings ─▶ parse + validate (pydantic-core, from the bytes) ─▶ size limits ─▶
    tokenize (``tokenizer_workers`` threads) ─▶ Batcher.submit_group (the core admits all inputs or
    none) ─▶ wait for all, the client's disconnect, or the request timeout ─▶ JSON (orjson)

Core rejections map by reason (too long 400, infeasible deadline and rate limit 429, queue full and
shutting down 503 with Retry-After, expired deadline 504). A client that disconnects while its inputs
wait has them withdrawn from the queue. ``Server-Timing`` on every answer says where its time went.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..core.config import SchedulerConfig
from ..core.costmodel import CostModel
from ..core.scheduler import RejectReason
from ..runtime.batcher import Batcher
from ..runtime.errors import ExecutionError, InvalidInput, RequestRejected
from ..runtime.execution import StageTimes
from ..runtime.executor import Executor
from .config import ServerConfig
from .errors import APIError, error_response, request_id_of, validation_response
from .metrics import ServerMetrics
from .schemas import PRIORITY_MAX, EmbeddingRequest

log = logging.getLogger("batchpilot.server")

_REJECT_STATUS = {RejectReason.TOO_LONG: 400, RejectReason.INFEASIBLE_DEADLINE: 429,
                  RejectReason.RATE_LIMITED: 429, RejectReason.QUEUE_FULL: 503,
                  RejectReason.SHUTTING_DOWN: 503, RejectReason.DEADLINE_EXPIRED: 504,
                  RejectReason.CANCELLED: 499}


# A request whose texts total at most this many characters (or token-id lists this many ids) is
# tokenised on the event loop: a fast tokenizer does that in about the time of the hand-off to a thread
# and back, so the loop is held no longer than a hand-off would hold it.
INLINE_TOKENIZE_CHARS = 64
INLINE_TOKENIZE_IDS = 512


def _cheap_to_tokenize(texts: list[str] | None, ids: list[list[int]] | None) -> bool:
    if texts is not None:
        return sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS
    return ids is not None and sum(len(x) for x in ids) <= INLINE_TOKENIZE_IDS


def tokenizer_workers(settings: ServerConfig) -> int:
    """Threads tokenising embedding inputs: the setting, else one per core this process may use (the
    simulator's serial stage has as many servers: ``FrontEnd.serial_servers``)."""
    return settings.tokenizer_workers or len(os.sched_getaffinity(0))


# the route's request body for the OpenAPI schema (the route parses it itself, from this same model)
EMBEDDING_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": EmbeddingRequest.model_json_schema()}}}}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def rejection_error(exc: RequestRejected) -> APIError:
    status = _REJECT_STATUS.get(exc.reason, 503)
    code = "context_length_exceeded" if exc.reason is RejectReason.TOO_LONG else exc.reason.value
    retry = exc.retry_after_s if status in (429, 503) else None
    if status in (429, 503) and retry is None and exc.reason is not RejectReason.INFEASIBLE_DEADLINE:
        retry = 1.0  # overload: always tell the client when to come back
    return APIError(status, exc.message, code=code, retry_after_s=retry)


class EmbeddingService:
    """Everything one request needs: the executor (tokenizer + model), its Batcher, metrics, settings."""

    def __init__(self, settings: ServerConfig, executor: Executor, config: SchedulerConfig,
                 cost_model: CostModel) -> None:
        self.settings = settings
        self.executor = executor
        self.metrics = ServerMetrics(config.num_slots)
        self.batcher = Batcher(executor, config, cost_model, observer=self.metrics)
        self.metrics.bind(self.batcher.scheduler, lambda: self.batcher.num_pending)
        self.model_name = settings.model_name or getattr(executor, "model_name", "model")
        self.dim = int(getattr(executor, "dim", 0)) or None
        self.max_length = getattr(executor, "max_length", config.admission.max_length)
        # a thread per core: the executors' tokenizers are called with fixed settings (a fast tokenizer
        # is shared safely then) and release the GIL while they work
        self.tokenizer_pool = ThreadPoolExecutor(tokenizer_workers(settings),
                                                 thread_name_prefix="batchpilot-tokenize")
        self.created = int(time.time())
        self._latency = self.metrics.http_latency.labels(route="/v1/embeddings")
        self._answered: dict[int, Any] = {}  # status -> its counter child (labels() is a lookup per call)

    def tokenize(self, texts: list[str] | None, ids: list[list[int]] | None,
                 truncate: bool) -> list[list[int]]:
        ex: Any = self.executor
        if texts is not None:
            return [list(x) for x in ex.tokenize(texts, truncate=truncate)]
        assert ids is not None
        if hasattr(ex, "tokenize_ids"):
            return [list(x) for x in ex.tokenize_ids(ids, truncate=truncate)]
        return [x[: self.max_length] if truncate else x for x in ids]

    async def handle(self, request: Request) -> Response:
        """POST /v1/embeddings, from the raw request to the response, errors included (an unexpected
        exception propagates to the request middleware's fixed 500). The body is parsed by
        pydantic-core straight from the bytes."""
        t0, status = time.perf_counter(), 200
        try:
            try:
                body = EmbeddingRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                status = 422
                return validation_response(exc.errors(include_url=False, include_context=False))
            return await self.embed(body, request)
        except APIError as exc:
            status = exc.status
            return error_response(exc, request_id_of(request))
        except ClientGone:
            status = 499
            return Response(status_code=499)
        except Exception:
            status = 500
            raise
        finally:
            counter = self._answered.get(status)
            if counter is None:
                counter = self._answered[status] = self.metrics.http_requests.labels(
                    route="/v1/embeddings", status=str(status))
            counter.inc()
            self._latency.observe(time.perf_counter() - t0)

    async def embed(self, body: EmbeddingRequest, request: Request) -> Response:
        received = self.batcher.clock()
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", code="model_not_found", param="model")
        if body.dimensions is not None and body.dimensions != self.dim:
            raise APIError(400, f"{self.model_name} returns {self.dim} dimensions and cannot shorten them; "
                                "omit dimensions", code="unsupported_dimensions", param="dimensions")
        texts, ids = split_input(body.input, self.settings)
        priority = body.priority if body.priority is not None else _header_num(request, "x-priority", int)
        budget_ms = body.deadline_ms if body.deadline_ms is not None else _header_num(
            request, "x-deadline-ms", float)
        if budget_ms is not None and budget_ms <= 0:
            raise APIError(400, "deadline_ms must be > 0", param="deadline_ms")
        deadline = received + budget_ms / 1000.0 if budget_ms is not None else None
        try:
            if _cheap_to_tokenize(texts, ids):  # less work than the hand-off to a tokenizer thread
                tokens = self.tokenize(texts, ids, body.truncate)
            else:
                tokens = await asyncio.get_running_loop().run_in_executor(
                    self.tokenizer_pool, self.tokenize, texts, ids, body.truncate)
            tokenized = self.batcher.clock()
        except InvalidInput as exc:
            raise APIError(400, str(exc), code=exc.code, param="input") from None
        except ValueError as exc:  # the tokenizer's own message stays in the log
            log.warning("request %s: the tokenizer refused the input: %s", request_id_of(request), exc)
            raise APIError(400, "the input could not be tokenised", code="invalid_input",
                           param="input") from None
        futures: list[asyncio.Future[Any]] = []
        times = StageTimes()
        try:  # the core admits or refuses the request's inputs together
            futures = self.batcher.submit_group_nowait(tokens, [len(x) for x in tokens], priority or 0,
                                                       deadline, times=times)
            results = await self._wait(futures, request)
            answered = self.batcher.clock()
        except RequestRejected as exc:
            raise rejection_error(exc) from None
        except ExecutionError as exc:
            raise APIError(500, str(exc), code="model_error") from None
        finally:
            for f in futures:
                f.cancel()  # no-op when done; withdraws the rest when one failed or the client left
        content = self._body(results, tokens, body.encoding_format)
        done = self.batcher.clock()
        # W3C Server-Timing: where this request's time went inside the server (`batchpilot profile`
        # measures the simulator's serving path from tokenize/batcher/app; browsers' dev tools show it).
        # queue, prepare (collation + hand-offs + waiting for the run stage) and run split the batcher's
        # part; encode is the response body.
        timing = (f"tokenize;dur={(tokenized - received) * 1e3:.3f}, "
                  f"batcher;dur={(answered - tokenized) * 1e3:.3f}, "
                  f"queue;dur={times.queue_s * 1e3:.3f}, prepare;dur={times.prepare_s * 1e3:.3f}, "
                  f"run;dur={times.run_s * 1e3:.3f}, encode;dur={(done - answered) * 1e3:.3f}, "
                  f"app;dur={(done - received) * 1e3:.3f}")
        return Response(content, media_type="application/json", headers={"server-timing": timing})

    async def _wait(self, futures: list[asyncio.Future[Any]], request: Request) -> list[Any]:
        work = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, watch}, timeout=self.settings.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work in done:
            return [work.result()] if len(futures) == 1 else list(work.result())
        work.cancel()  # withdraws every input still queued
        work.add_done_callback(lambda f: None if f.cancelled() else f.exception())  # mark it retrieved
        if watch in done:
            raise ClientGone
        raise APIError(504, f"not answered within {self.settings.request_timeout_s:.0f} s", code="timeout")

    def _body(self, results: Sequence[Any], tokens: list[list[int]], fmt: str) -> bytes:
        """The response JSON (orjson writes float32 arrays directly). A non-finite value (a half
        precision overflow) is a fixed 500, never a JSON ``null`` or NaN the client cannot parse."""
        data = []
        for i, vec in enumerate(results):
            arr = np.ascontiguousarray(vec, dtype=np.float32)
            if not np.isfinite(arr).all():
                log.error("embedding %d of the request is not finite (model output overflow)", i)
                raise APIError(500, "the model produced a non-finite embedding", code="model_error")
            emb: Any = arr  # OpenAI's base64: little-endian float32 bytes
            if fmt != "float":
                emb = base64.b64encode(arr.astype("<f4", copy=False).tobytes()).decode()
            data.append({"object": "embedding", "embedding": emb, "index": i})
        n = sum(len(t) for t in tokens)
        body = {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n}}
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

    async def close(self) -> None:
        await self.batcher.shutdown(self.settings.drain_timeout_s)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def split_input(value: Any, limits: ServerConfig) -> tuple[list[str] | None, list[list[int]] | None]:
    """Normalise the four OpenAI input shapes to texts or token-id lists, within the limits
    (``max_inputs`` per request, ``max_input_chars`` per text, ``max_input_tokens`` per token list);
    empty things, lone surrogates and anything over a limit are 400s."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        value = [value]
    if not value:
        raise APIError(400, "input must not be empty", code="empty_input", param="input")
    if len(value) > limits.max_inputs:
        raise APIError(400, f"input has {len(value)} items; at most {limits.max_inputs} per request",
                       code="too_many_inputs", param="input")
    if isinstance(value[0], str):
        for i, t in enumerate(value):
            if not t:
                raise APIError(400, f"input[{i}] is an empty string", code="empty_input", param="input")
            if len(t) > limits.max_input_chars:
                raise APIError(400, f"input[{i}] has {len(t)} characters; at most {limits.max_input_chars}",
                               code="input_too_long", param="input")
        return list(value), None
    for i, ids in enumerate(value):
        if not ids:
            raise APIError(400, f"input[{i}] is an empty token list", code="empty_input", param="input")
        if len(ids) > limits.max_input_tokens:
            raise APIError(400, f"input[{i}] has {len(ids)} token ids; at most {limits.max_input_tokens}",
                           code="input_too_long", param="input")
    return None, [list(x) for x in value]


def _header_num(request: Request, name: str, kind: type) -> Any:
    """A numeric header: an int within the priority range, or a finite float; anything else is 400."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    value: Any = None
    try:
        value = kind(raw)
        ok = -PRIORITY_MAX <= value <= PRIORITY_MAX if kind is int else math.isfinite(value)
    except (ValueError, OverflowError):
        ok = False
    if not ok:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        what = f"an integer in [-{PRIORITY_MAX}, {PRIORITY_MAX}]" if kind is int else "a finite number"
        raise APIError(400, f"header {name} must be {what}, got {shown!r}", code="invalid_value", param=name)
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the next message is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
