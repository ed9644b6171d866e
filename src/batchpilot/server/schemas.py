"""Request and response bodies of the encoder routes (pydantic v2): embeddings first, then scoring,
classification and tokenizing (their section below).

``input`` is strict: a string, a list of strings, a list of token ids, or a list of token-id lists —
``[1, "a"]``, ``true`` or ``[[1], "a"]`` are 422s, never coerced. ``priority``, ``deadline_ms``,
``truncate`` and ``prompt_name`` are extensions (the OpenAI client passes them through ``extra_body``);
the headers ``X-Priority`` / ``X-Deadline-Ms`` set the first two without touching the body.

Validation stops at a list's first bad item (``fail_fast``): a body of a million bad items gives one
error per shape of ``input``, not a million. The limits on sizes (inputs per request, characters per
text, ids per token list) are the server's settings, checked after this (``app.split_input``); the
request middleware bounds the body's bytes and JSON structure before anything parses it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

PRIORITY_MAX = 2**31 - 1  # priorities are compared as floats in the core: keep them exact and finite

_Texts = Annotated[list[StrictStr], Field(fail_fast=True)]
_Ids = Annotated[list[StrictInt], Field(fail_fast=True)]
_IdLists = Annotated[list[_Ids], Field(fail_fast=True)]
EmbeddingInput = StrictStr | _Texts | _Ids | _IdLists


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: EmbeddingInput = Field(description="text, texts, token ids, or lists of token ids")
    model: str | None = Field(default=None, description="the served model's name (GET /v1/models)")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description=(
        "keep the first N coordinates, re-normalised when the model normalises (matryoshka); at most "
        "the model's size (GET /v1/models)"))
    embedding_type: Literal["float", "int8", "uint8", "binary", "ubinary"] = Field(
        default="float", description="scalar int8/uint8 on the fixed range [-1, 1], or sign bits packed "
                                     "8 per byte (binary: as int8, ubinary: as uint8); docs/server.md")
    user: str | None = None
    priority: int | None = Field(default=None, ge=-PRIORITY_MAX, le=PRIORITY_MAX,
                                 description="lower is served first; 0 is the default class")
    deadline_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                      description="latency budget from receipt; infeasible -> 429")
    truncate: bool = Field(default=False, description="cut inputs longer than the model's limit")
    prompt_name: str | None = Field(default=None, description=(
        "a prompt of the model's sentence-transformers config, put before every input (TEI's and "
        "sentence-transformers' name); default: the checkpoint's default prompt, if it names one"))


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | list[int] | str  # base64 of the raw bytes when encoding_format is base64
    index: int


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchpilot"
    max_model_len: int | None = None
    dimensions: int | None = None
    task: str | None = Field(default=None, description="embed, score, classify or generate")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "degraded", "draining", "stopped"]
    model: str = Field(description="the first served model")
    models: list[str] = Field(default_factory=list, description="every served model, in order")
    queued: int
    running: int
    pending: int
    arms: dict[str, dict[str, str]] | None = Field(
        default=None, description="models served in arms: each arm's state (serving, rolled_back)")


# -- Scoring, classification and tokenizing --------------------------------------------------------
# Request and response bodies of the scoring, classification and tokenizer routes (pydantic v2).
#
#     POST /v1/rerank      RerankRequest    -> RerankResponse    (the Cohere / Jina / vLLM body)
#     POST /v1/score       ScoreRequest     -> ScoreResponse     (vLLM's text_1 / text_2)
#     POST /v1/classify    ClassifyRequest  -> ClassifyResponse  (vLLM's)
#     POST /tokenize       TokenizeRequest  -> TokenizeResponse  (vLLM's)
#     POST /detokenize     DetokenizeRequest -> DetokenizeResponse
#
# Strict like the embeddings body: texts are strings, never coerced. ``priority``, ``deadline_ms`` and
# ``truncate`` are batchpilot extensions, as on ``/v1/embeddings`` (and the ``X-Priority`` /
# ``X-Deadline-Ms`` headers); the number of pairs or inputs is bounded by the server's ``max_inputs``.



class _Scheduling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, description="the served model's name (GET /v1/models)")
    priority: int | None = Field(default=None, ge=-PRIORITY_MAX, le=PRIORITY_MAX,
                                 description="lower is served first; 0 is the default class")
    deadline_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                      description="latency budget from receipt; infeasible -> 429")
    truncate: bool = Field(default=False, description=(
        "cut inputs longer than the model's limit (pairs: the longer side first); otherwise 400"))
    user: str | None = Field(default=None, description=(
        "the client's name for itself: its tenant on a server without API keys (docs/tenants.md)"))


class RerankRequest(_Scheduling):
    query: StrictStr
    documents: _Texts = Field(description="the texts to rank against the query")
    top_n: int | None = Field(default=None, ge=1, description="return the best N (default: all)")
    return_documents: bool = Field(default=True, description="echo each document's text")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="best first; index is the document's position")


class ScoreRequest(_Scheduling):
    text_1: StrictStr | _Texts = Field(description="one text (scored against every text_2) or a list")
    text_2: StrictStr | _Texts = Field(description="one text, or a list as long as text_1 (pairwise)")


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData] = Field(description="in input order; index is the pair's position")
    usage: Usage


class ClassifyRequest(_Scheduling):
    input: StrictStr | _Texts = Field(description="a text or a list of texts")


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: Usage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: _Ids


class DetokenizeResponse(BaseModel):
    prompt: str
