"""Real English texts of an exact token length, for conv-embed load tests and live benchmarks.

The source is offline and ships with Python: the documentation topics in ``pydoc_data.topics``
(~465 KB of English prose and code). The corpus is tokenised once per tokenizer (cached); a text of
``L`` tokens is a window of ``L - specials`` corpus tokens that starts and ends on whitespace, so the
cut does not split a word and re-tokenising the text gives the same tokens. Every text is checked by
tokenising it again (with the model's special tokens, which is what the model computes and what
admission counts); a window that does not round-trip is replaced by another. Windows are chosen by a
seeded generator, so the same seed gives the same texts.

``transformers`` is not imported here: pass any fast tokenizer object (``AutoTokenizer.from_pretrained``
or ``EncoderExecutor``'s), it only needs ``__call__`` with ``return_offsets_mapping``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_CORPUS_CACHE: dict[tuple[str, str, int], _Corpus] = {}


@dataclass(frozen=True)
class _Corpus:
    text: str
    starts: np.ndarray  # char offset where token i starts
    ends: np.ndarray  # char offset where token i ends
    clean_start: np.ndarray  # token i begins after whitespace (or at 0)
    clean_end: np.ndarray  # a window ending with token i stops before whitespace (or at the end)


def _corpus_text() -> str:
    from pydoc_data.topics import topics

    # collapse whitespace runs: windows read as prose and the tokenizer sees the same words
    return " ".join(" ".join(topics[k].split()) for k in sorted(topics))


def _corpus(tokenizer: Any) -> _Corpus:
    key = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer))
    cached = _CORPUS_CACHE.get(key)
    if cached is not None:
        return cached
    text = _corpus_text()
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except (NotImplementedError, TypeError) as exc:
        raise ValueError("texts_for_lengths needs a fast tokenizer (offset mapping); load it with "
                         "AutoTokenizer.from_pretrained(..., use_fast=True)") from exc
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    before = np.array([s == 0 or text[s - 1].isspace() for s in starts.tolist()], dtype=bool)
    after = np.array([e >= len(text) or text[e].isspace() for e in ends.tolist()], dtype=bool)
    corpus = _Corpus(text, starts, ends, before, after)
    _CORPUS_CACHE[key] = corpus
    return corpus


def _count_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    enc = tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)
    return [len(ids) for ids in enc["input_ids"]]


def texts_for_lengths(
    tokenizer: Any, lengths: Sequence[int], seed: int = 0, max_tries: int = 50
) -> list[str]:
    """One real text per entry of ``lengths`` whose tokenisation (with special tokens) has exactly that
    many tokens. Raises ``ValueError`` for a length the corpus cannot give (too short or too long)."""
    corpus = _corpus(tokenizer)
    specials = int(tokenizer.num_special_tokens_to_add(pair=False))
    n_tok = len(corpus.starts)
    rng = np.random.default_rng(seed)
    good_starts = np.flatnonzero(corpus.clean_start)
    out: list[str | None] = [None] * len(lengths)
    todo = list(range(len(lengths)))
    for _ in range(max_tries):
        if not todo:
            break
        cand: list[str] = []
        for idx in todo:
            k = int(lengths[idx]) - specials
            if k < 1 or k > n_tok:
                raise ValueError(f"texts_for_lengths: length {lengths[idx]} is outside "
                                 f"1 + {specials} special tokens .. {n_tok + specials}")
            cand.append(_window(corpus, good_starts, k, rng))
        counts = _count_tokens(tokenizer, cand)
        retry = []
        for idx, text, c in zip(todo, cand, counts, strict=True):
            if c == int(lengths[idx]):
                out[idx] = text
            else:
                retry.append(idx)
        todo = retry
    if todo:
        missing = [lengths[i] for i in todo[:5]]
        raise ValueError(f"texts_for_lengths: no exact window found for lengths {missing}")
    return [t for t in out if t is not None]


def _window(corpus: _Corpus, good_starts: np.ndarray, k: int, rng: np.random.Generator) -> str:
    """A random window of ``k`` tokens on word boundaries (a few draws; any window as a last resort)."""
    limit = len(corpus.starts) - k
    usable = good_starts[: int(np.searchsorted(good_starts, limit, side="right"))]
    for _ in range(20):
        i = int(usable[rng.integers(len(usable))]) if len(usable) else 0
        if corpus.clean_end[i + k - 1]:
            break
    return corpus.text[corpus.starts[i]: corpus.ends[i + k - 1]]
