"""The routes of a sequence-classification model: rerank and score (a cross-encoder, one output) and
classify (one output per label).

    POST /v1/rerank    query x documents -> pairs ─▶ tokenize_pairs ─▶ the core admits the pairs as one
                       group (they may run in different batches; each pair's length is its tokens,
                       query and document together) ─▶ scores, best first, ``top_n``
    POST /v1/score     text_1 x text_2: one text against a list (1:N), or two lists pairwise (N:N);
                       scores in input order, as vLLM answers
    POST /v1/classify  texts ─▶ probabilities (the model's activation: softmax, or sigmoid for one
                       output or a multi-label model) and the most likely label

A score is the model's activation of its one logit (sigmoid unless its sentence-transformers config
says otherwise), what ``CrossEncoder.predict`` returns. Limits are the embeddings route's: at most
``max_inputs`` pairs or texts, ``max_input_chars`` per text.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.executor import ModelExecutor
from batchpilot.server.config import ServerConfig
from batchpilot.server.errors import APIError, request_id_of
from batchpilot.server.schemas import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from batchpilot.server.service import INLINE_TOKENIZE_CHARS, ModelService


class ScoringService(ModelService):
    """A sequence-classification model: ``score`` (rerank, score) or ``classify``."""

    def __init__(self, settings: ServerConfig, executor: ModelExecutor, config: SchedulerConfig,
                 cost_model: CostModel, name: str | None = None) -> None:
        super().__init__(settings, executor, config, cost_model, name)
        self.task = executor.task
        self.labels = list(getattr(executor, "labels", []))

    # -- rerank / score ------------------------------------------------------------------------
    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        if not body.documents:
            raise APIError(400, "documents must not be empty", code="empty_input", param="documents")
        scores, tokens = await self._score_pairs([(body.query, d) for d in body.documents], body, request)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or len(scores)]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=body.documents[i]) if body.return_documents
                                else None) for i in order]
        out = RerankResponse(id=f"rerank-{request_id_of(request) or ''}", model=self.model_name,
                             usage=RerankUsage(total_tokens=tokens), results=results)
        return Response(out.model_dump_json(exclude_none=True), media_type="application/json")

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        left = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
        right = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
        if not left or not right:
            raise APIError(400, "text_1 and text_2 must not be empty", code="empty_input", param="text_1")
        if len(left) == 1:
            left = left * len(right)
        elif len(right) == 1:
            right = right * len(left)
        elif len(left) != len(right):
            raise APIError(400, f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text on "
                                "a side, or two lists of the same length", code="invalid_value",
                           param="text_2")
        scores, tokens = await self._score_pairs(list(zip(left, right, strict=True)), body, request)
        out = ScoreResponse(id=f"score-{request_id_of(request) or ''}", created=self.created,
                            model=self.model_name, data=[ScoreData(index=i, score=s)
                                                         for i, s in enumerate(scores)],
                            usage={"prompt_tokens": tokens, "total_tokens": tokens})  # type: ignore[arg-type]
        return Response(out.model_dump_json(), media_type="application/json")

    async def _score_pairs(self, pairs: list[tuple[str, str]], body: Any,
                           request: Request) -> tuple[list[float], int]:
        if self.task != "score":
            raise APIError(400, f"{self.model_name} is a classifier with {len(self.labels)} labels, not a "
                                "cross-encoder; use /v1/classify", code="unsupported_task", param="model")
        self._check_sizes([t for p in pairs for t in p], len(pairs), "pairs")
        probs, tokens = await self._run(self.executor.tokenize_pairs, pairs, body, request)  # type: ignore[attr-defined]
        return [float(p[0]) for p in probs], tokens

    # -- classify -------------------------------------------------------------------------------
    async def classify(self, body: ClassifyRequest, request: Request) -> Response:
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if not texts or any(not t for t in texts):
            raise APIError(400, "input must not be empty or hold an empty string", code="empty_input",
                           param="input")
        self._check_sizes(texts, len(texts), "inputs")
        probs, tokens = await self._run(self.executor.tokenize, texts, body, request)  # type: ignore[attr-defined]
        labels = self.labels or [f"LABEL_{i}" for i in range(probs.shape[1])]
        data = [ClassifyData(index=i, label=labels[int(np.argmax(p))], probs=[float(x) for x in p],
                             num_classes=len(p)) for i, p in enumerate(probs)]
        out = ClassifyResponse(id=f"classify-{request_id_of(request) or ''}", created=self.created,
                               model=self.model_name, data=data,
                               usage={"prompt_tokens": tokens, "total_tokens": tokens})  # type: ignore[arg-type]
        return Response(out.model_dump_json(), media_type="application/json")

    # -- shared ---------------------------------------------------------------------------------
    async def _run(self, tokenize: Any, items: list[Any], body: Any,
                   request: Request) -> tuple[np.ndarray, int]:
        """Tokenise ``items``, run them as one admitted group, and return the activated outputs
        (``[n, num_labels]``) and the request's token count."""
        received = self.batcher.clock()
        priority, deadline = self.deadline(request, body.priority, body.deadline_ms, received)
        tenant = self.tenant(request, body.user, len(items))
        chars = sum(len(t) for x in items for t in (x if isinstance(x, tuple) else (x,)))
        payloads = await self.tokenize_off_loop(functools.partial(tokenize, items, body.truncate),
                                                cheap=chars <= INLINE_TOKENIZE_CHARS, request=request)
        lengths = [len(p.token_ids) for p in payloads]
        logits = await self.run_group(payloads, lengths, request, priority, deadline, tenant=tenant)
        probs = self.executor.scores(np.stack(logits))  # type: ignore[attr-defined]
        if not np.isfinite(probs).all():
            raise APIError(500, "the model produced a non-finite score", code="model_error")
        return probs, sum(lengths)

    def _check_sizes(self, texts: list[str], count: int, what: str) -> None:
        limit = self.settings.max_inputs
        if count > limit:
            raise APIError(400, f"the request has {count} {what}; at most {limit} per request",
                           code="too_many_inputs", param="input")
        for t in texts:
            if len(t) > self.settings.max_input_chars:
                raise APIError(400, f"a text has {len(t)} characters; at most "
                                    f"{self.settings.max_input_chars}", code="input_too_long", param="input")
