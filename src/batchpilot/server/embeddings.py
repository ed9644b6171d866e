"""The embeddings route for one embedding model: validate, tokenise, admit through the core, answer.

    POST /v1/embeddings ─▶ parse + validate (pydantic-core, from the bytes) ─▶ size limits ─▶
    the prompt (``prompt_name``, else the checkpoint's default; unknown: 400) ─▶ tokenize, prompt first
    (on the loop when short, else ``tokenizer_workers`` threads) ─▶ Batcher.submit_group (the core
    admits all inputs or none) ─▶ wait (``service.ModelService``) ─▶ ``dimensions`` and
    ``embedding_type`` (``server/vectors.py``) ─▶ JSON (orjson)

The prompt's tokens count like the input's: towards the model's length limit and in ``usage``.

``Server-Timing`` on every answer says where its time went.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.batcher import StageTimes
from batchpilot.runtime.executor import ModelExecutor
from batchpilot.server import vectors
from batchpilot.server.config import ServerConfig
from batchpilot.server.errors import APIError
from batchpilot.server.schemas import EmbeddingRequest
from batchpilot.server.service import INLINE_TOKENIZE_CHARS, INLINE_TOKENIZE_IDS, ModelService

log = logging.getLogger("batchpilot.server")


def _cheap_to_tokenize(texts: list[str] | None, ids: list[list[int]] | None) -> bool:
    if texts is not None:
        return sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS
    return ids is not None and sum(len(x) for x in ids) <= INLINE_TOKENIZE_IDS


# the route's request body for the OpenAPI schema (the route parses it itself, from this same model)
EMBEDDING_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": EmbeddingRequest.model_json_schema()}}}}


class EmbeddingService(ModelService):
    """``POST /v1/embeddings`` for one embedding model."""

    task = "embed"

    def __init__(self, settings: ServerConfig, executor: ModelExecutor, config: SchedulerConfig,
                 cost_model: CostModel, name: str | None = None) -> None:
        super().__init__(settings, executor, config, cost_model, name)
        self.dim = int(executor.dim) or None
        self.normalizes = bool(getattr(executor, "normalizes", True))  # re-normalise truncated vectors
        # the checkpoint's prompts (models/st_modules.py); a model without them takes no prompt_name
        self.prompts: dict[str, str] = dict(getattr(executor, "prompts", None) or {})

    def check_prompt(self, name: str | None) -> dict[str, str]:
        """The tokenizer's prompt argument for ``prompt_name`` (none when the body names none: the
        executor applies the checkpoint's default); an unknown name is a 400 listing the known ones."""
        if name is None:
            return {}
        if name not in self.prompts:
            known = ", ".join(repr(k) for k in self.prompts) or "none (its checkpoint defines no prompts)"
            raise APIError(400, f"unknown prompt_name {name!r}; {self.model_name}'s prompts are: {known}",
                           code="invalid_prompt_name", param="prompt_name")
        return {"prompt_name": name}

    def tokenize(self, texts: list[str] | None, ids: list[list[int]] | None, truncate: bool,
                 prompt: dict[str, str] | None = None) -> list[list[int]]:
        ex: Any = self.executor
        prompt = prompt or {}
        if texts is not None:
            return [list(x) for x in ex.tokenize(texts, truncate=truncate, **prompt)]
        assert ids is not None
        if hasattr(ex, "tokenize_ids"):
            return [list(x) for x in ex.tokenize_ids(ids, truncate=truncate, **prompt)]
        return [x[: self.max_length] if truncate else x for x in ids]

    async def answer(self, body: EmbeddingRequest, request: Request) -> Response:
        received = self.batcher.clock()
        if body.dimensions is not None and self.dim is not None and body.dimensions > self.dim:
            raise APIError(400, f"{self.model_name} returns {self.dim} dimensions; dimensions must be "
                                f"between 1 and {self.dim}", code="unsupported_dimensions",
                           param="dimensions")
        texts, ids = split_input(body.input, self.settings)
        prompt = self.check_prompt(body.prompt_name)
        priority, deadline = self.deadline(request, body.priority, body.deadline_ms, received)
        tenant = self.tenant(request, body.user, len(texts if texts is not None else ids or ()))
        tokens = await self.tokenize_off_loop(functools.partial(self.tokenize, texts, ids, body.truncate,
                                                                prompt),
                                              cheap=_cheap_to_tokenize(texts, ids), request=request)
        tokenized = self.batcher.clock()
        times = StageTimes()
        results = await self.run_group(tokens, [len(x) for x in tokens], request, priority, deadline, times,
                                       tenant)
        answered = self.batcher.clock()
        content = self._body(results, tokens, body)
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

    def _body(self, results: Sequence[Any], tokens: list[list[int]], body: EmbeddingRequest) -> bytes:
        """The response JSON (orjson writes numpy arrays directly). A non-finite value (a half
        precision overflow) is a fixed 500, never a JSON ``null`` or NaN the client cannot parse.
        ``dimensions`` truncates (and re-normalises, for a normalising model) before ``embedding_type``
        quantises (``server/vectors.py``)."""
        arr = np.ascontiguousarray(np.stack([np.asarray(v, dtype=np.float32) for v in results]))
        if not np.isfinite(arr).all():
            bad = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
            log.error("embedding %d of the request is not finite (model output overflow)", bad)
            raise APIError(500, "the model produced a non-finite embedding", code="model_error")
        arr = vectors.quantize(vectors.truncate(arr, body.dimensions, self.normalizes), body.embedding_type)
        data = [{"object": "embedding", "index": i,
                 "embedding": vectors.encode(row, body.embedding_type, body.encoding_format)}
                for i, row in enumerate(arr)]
        n = sum(len(t) for t in tokens)
        out = {"object": "list", "data": data, "model": self.model_name,
               "usage": {"prompt_tokens": n, "total_tokens": n}}
        return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


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
