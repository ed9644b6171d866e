"""The sequence-classification executor: cross-encoder reranking (one score per pair) and classification.

Any local HF folder that ``AutoModelForSequenceClassification`` loads (a sentence-transformers
``CrossEncoder`` folder included) runs batch by batch for the runtime:

    tokenize / tokenize_pairs / tokenize_ids   request side (thread-safe): ``PairTokens`` payloads, with
                    special tokens and token type ids, from texts, (query, document) pairs or client ids;
                    too long -> ``InvalidInput(code="context_length_exceeded")`` unless ``truncate``
                    (pairs: HF's ``longest_first``; single texts keep their closing special token).
    prepare(batch)  CPU collation in a worker thread: ``input_ids`` / ``attention_mask`` /
                    ``token_type_ids`` of width ``min(batch.padded_len, max_length)``, right padded, staged
                    to the device (models/device.py).
    run(prepared)   the forward under ``inference_mode``: one float32 logits row ``[num_labels]`` per
                    request, in order. ``scores`` / ``activate`` turn logits into scores.

``activation`` is what turns logits into scores: a sentence-transformers entry in config.json
(``sentence_transformers.activation_fn``, or the older ``sbert_ce_default_activation_function``) wins,
Sigmoid -> "sigmoid", Identity -> "none", Softmax -> "softmax"; otherwise "sigmoid" for one label or
``problem_type == "multi_label_classification"``, else "softmax". ``task`` is "score" for one label,
else "classify". There is no padding-free forward.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from batchpilot.core.batch import Batch
from batchpilot.models.device import HostToDevice, Staged, configure_threads, resolve_device
from batchpilot.models.encoder import _FAIRSEQ_POSITIONS, DTYPES, _default_name, make_batch
from batchpilot.models.tokens import InvalidInput, TextTokenizer

Activation = Literal["sigmoid", "softmax", "none"]
_ST_ACTIVATIONS: dict[str, Activation] = {"Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax"}


@dataclass(frozen=True)
class ClassifierConfig:
    """What to load and how to run it. ``max_length`` None = the model's position limit."""

    model_path: str
    model_name: str | None = None
    device: str = "auto"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_length: int | None = None
    num_threads: int | None = None  # CPU intra-op threads; None = every core this process may use

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("classifier.model_path is required (a local sequence-classification folder)")
        if self.dtype not in DTYPES:
            raise ValueError(f"classifier.dtype = {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(f"classifier.max_length must be >= 3 (room for a pair's special tokens), "
                             f"got {self.max_length}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(
                f"classifier.num_threads must be >= 1 or None (all cores), got {self.num_threads}")


@dataclass(frozen=True)
class PairTokens:
    """One request's payload: token ids with special tokens and their token type ids (same length)."""

    token_ids: list[int]
    type_ids: list[int]

    def __len__(self) -> int:
        return len(self.token_ids)


class SequenceClassifierExecutor:
    """Runs an HF sequence-classification model for the runtime (prepare/run) and for users."""

    def __init__(self, config: ClassifierConfig) -> None:
        self.config = cfg = config
        self.model_path = path = cfg.model_path
        self.model_name = cfg.model_name or _default_name(path)
        self.num_threads = configure_threads(cfg.num_threads)
        self.device = resolve_device(cfg.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            raise ValueError(f"{self.model_name}: a fast (Rust) tokenizer is required (tokenizer.json)")
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=DTYPES[cfg.dtype]).to(self.device).eval()
        mcfg = self.model.config
        offset = (mcfg.pad_token_id + 1) if mcfg.model_type in _FAIRSEQ_POSITIONS else 0
        limit = int(mcfg.max_position_embeddings) - offset
        self.max_length = cfg.max_length or limit
        if self.max_length > limit:
            raise ValueError(f"classifier.max_length = {self.max_length} exceeds {self.model_name}'s "
                             f"position limit of {limit} tokens; set max_length <= {limit}")
        self.vocab_size = int(mcfg.vocab_size)
        self.num_labels = int(mcfg.num_labels)
        self.dim = self.num_labels
        id2label = {int(k): str(v) for k, v in (getattr(mcfg, "id2label", None) or {}).items()}
        self.labels = [id2label.get(i, f"LABEL_{i}") for i in range(self.num_labels)]
        self.activation: Activation = _activation(mcfg, self.num_labels, self.model_name)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self._has_token_types = "token_type_ids" in self.tokenizer.model_input_names
        # Fixed settings per backend copy: changing them per call is not thread-safe ("Already borrowed").
        self._plain = _backend(self.tokenizer, None)
        self._truncating = _backend(self.tokenizer, self.max_length)
        self.tokens = TextTokenizer(self.tokenizer, self.max_length, self.model_name, self.vocab_size)
        # "score" (one output: rerank, score) or "classify"; ``models.tasks`` may serve a one-output
        # model as classify
        self.task: Literal["score", "classify"] = "score" if self.num_labels == 1 else "classify"
        self._h2d = HostToDevice(self.device)

    # -- tokenisation (request handler side, thread-safe) -------------------------------------
    def tokenize(self, texts: Sequence[str], truncate: bool = False) -> list[PairTokens]:
        """Single texts (classification): ``TextTokenizer.tokenize``, type ids 0."""
        return [PairTokens(r, [0] * len(r)) for r in self.tokens.tokenize([str(t) for t in texts], truncate)]

    def tokenize_ids(self, inputs: Sequence[Sequence[int]], truncate: bool = False) -> list[PairTokens]:
        """Client token ids of single texts (``TextTokenizer.tokenize_ids``), type ids 0."""
        rows = self.tokens.tokenize_ids([list(x) for x in inputs], truncate)
        return [PairTokens(r, [0] * len(r)) for r in rows]

    def tokenize_pairs(self, pairs: Sequence[tuple[str, str]], truncate: bool = False) -> list[PairTokens]:
        """(query, document) pairs (reranking), truncated ``longest_first`` if asked. Too long and not
        ``truncate`` -> InvalidInput."""
        items: list[tuple[str, str]] = []
        for i, pair in enumerate(pairs):
            if isinstance(pair, str) or len(pair) != 2:
                raise InvalidInput(f"input {i}: a pair is two texts (query, document)")
            items.append((str(pair[0]), str(pair[1])))
        backend = self._truncating if truncate else self._plain
        encs = backend.encode_batch(items, add_special_tokens=True) if items else []
        rows = [PairTokens(list(e.ids), list(e.type_ids)) for e in encs]
        self.tokens.check_lengths([r.token_ids for r in rows])
        return rows

    def token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokens.token_ids(text, add_special_tokens)

    @property
    def num_special_tokens(self) -> int:
        """Tokens ``tokenize`` adds around a single text (the profiler's inputs are single texts: a
        pair of the same total length costs the same)."""
        return self.tokens.num_special_tokens

    def detokenize(self, ids: list[int]) -> str:
        return self.tokens.detokenize(ids)

    # -- the runtime's Executor protocol --------------------------------------------------------
    def prepare(self, batch: Batch) -> Staged:
        rows = [_payload_tokens(r.payload, r.id) for r in batch.requests]
        longest = max(len(r.token_ids) for r in rows)
        if longest > self.max_length:
            raise ValueError(
                f"batch {batch.id}: an input has {longest} tokens; the limit is {self.max_length}")
        if batch.padding == "none":  # no padding-free forward: the tightest padded one
            width = longest
        elif batch.padded_len < longest:
            raise ValueError(f"batch {batch.id}: padded_len {batch.padded_len} < longest input {longest}; "
                             "the planner must pad to at least the longest request")
        else:  # a planner configured past this model's limit still fits
            width = min(batch.padded_len, self.max_length)
        return self._h2d.stage(self._collate(rows, width))

    def _collate(self, rows: list[PairTokens], width: int) -> dict[str, torch.Tensor]:
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if self._has_token_types else [])
        out = {k: self._h2d.host_empty((len(rows), width), torch.int64) for k in names}
        arrays = [out[k].numpy() for k in names]  # ids, mask[, type ids], filled row by row below
        for a, fill in zip(arrays, (self.pad_id, 0, 0), strict=False):
            a.fill(fill)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            for a, values in zip(arrays, (row.token_ids, 1, row.type_ids), strict=False):
                a[i, :n] = values
        return out

    def run(self, prepared: Staged) -> list[np.ndarray]:
        with torch.inference_mode():
            t = prepared.wait()
            arr = self.model(**t).logits.float().cpu().numpy()
        if arr.shape != (t["input_ids"].shape[0], self.num_labels):
            raise RuntimeError(f"{self.model_name} returned logits of shape {arr.shape} for a batch of "
                               f"{t['input_ids'].shape[0]} and {self.num_labels} labels")
        return list(arr)

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """``activate(logits, self.activation)``: a logits row (or rows) -> scores / probabilities."""
        return activate(logits, self.activation)

    def supports_padding_free(self) -> bool:
        return False

    # -- conveniences ---------------------------------------------------------------------------
    def predict_pairs(self, pairs: Sequence[tuple[str, str]], truncate: bool = False) -> np.ndarray:
        """Scores of (query, document) pairs in one batch: ``[n]`` for one label, else ``[n, num_labels]``."""
        out = self._predict(self.tokenize_pairs(pairs, truncate))
        return out[:, 0] if self.num_labels == 1 else out

    def classify(self, texts: Sequence[str], truncate: bool = False) -> np.ndarray:
        """Activated scores (probabilities for softmax/sigmoid) of texts in one batch: ``[n, num_labels]``."""
        return self._predict(self.tokenize(texts, truncate))

    def _predict(self, rows: list[PairTokens]) -> np.ndarray:
        if not rows:
            return np.zeros((0, self.num_labels), dtype=np.float32)
        batch = make_pair_batch(rows, "dynamic", self.max_length)
        return activate(np.stack(self.run(self.prepare(batch))), self.activation)

    def warmup(self) -> None:
        """First calls pay for lazy init (allocator, kernels, thread pool): run two small batches."""
        for n, words in ((1, 2), (4, 24)):
            text = " ".join(["warm"] * words)
            rows = self.tokenize_pairs([(text, text)] * n, truncate=True)
            self.run(self.prepare(make_pair_batch(rows, "dynamic", self.max_length)))


def make_pair_batch(rows: list[PairTokens], padding: str, max_length: int, batch_id: int = 0) -> Batch:
    """A hand-built ``Batch`` of ``PairTokens`` payloads (what the planner would make), via ``make_batch``."""
    batch = make_batch([r.token_ids for r in rows], padding, max_length, batch_id)
    for req, row in zip(batch.requests, rows, strict=True):
        req.payload = row
    return batch


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """Scores from logits along the last axis: "sigmoid", "softmax" (numerically stable) or "none"."""
    x = np.asarray(logits, dtype=np.float32)
    if activation == "none":
        return x.copy()
    if activation == "sigmoid":
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32)
    if activation == "softmax":
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        out: np.ndarray = (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)
        return out
    raise ValueError(f"activation {activation!r}; choose 'sigmoid', 'softmax' or 'none'")


def _activation(mcfg: Any, num_labels: int, model_name: str) -> Activation:
    st = getattr(mcfg, "sentence_transformers", None)
    path = st.get("activation_fn") if isinstance(st, dict) else None
    path = path or getattr(mcfg, "sbert_ce_default_activation_function", None)
    if isinstance(path, str):
        found = _ST_ACTIVATIONS.get(path.rsplit(".", 1)[-1])
        if found is not None:
            return found
        warnings.warn(f"{model_name}: sentence-transformers activation {path!r} is not supported; "
                      "using the default for the model's labels", stacklevel=3)
    if num_labels == 1 or getattr(mcfg, "problem_type", None) == "multi_label_classification":
        return "sigmoid"
    return "softmax"


def _payload_tokens(payload: Any, request_id: int) -> PairTokens:
    if isinstance(payload, PairTokens):
        if not payload.token_ids or len(payload.type_ids) != len(payload.token_ids):
            raise ValueError(f"request {request_id}: PairTokens need non-empty token_ids and type_ids "
                             "of the same length")
        return payload
    if isinstance(payload, (list, tuple)) and payload:  # plain id lists: a single text, type ids 0
        return PairTokens([int(t) for t in payload], [0] * len(payload))
    raise ValueError(f"request {request_id}: payload must be PairTokens, got {type(payload).__name__}")


def _backend(tokenizer: Any, truncate_to: int | None) -> Any:
    """A private copy of the fast tokenizer's Rust backend with fixed settings: never pads; truncates
    ``longest_first`` to ``truncate_to`` (on the tokenizer's truncation side), or never."""
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.no_padding()
    if truncate_to is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(truncate_to, strategy="longest_first",
                                  direction=getattr(tokenizer, "truncation_side", "right"))
    return backend
