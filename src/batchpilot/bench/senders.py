"""One request to an OpenAI-compatible server, per endpoint, and what its answer writes into its
``RequestRecord``: status, the arm that answered, an error, the server's own timings, and for a
stream its TTFT, inter-token gaps and token count. ``discover_model`` asks the server what to name
in the body.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from typing import Any, Literal

import httpx
import numpy as np

from batchpilot.bench.records import RequestRecord

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
