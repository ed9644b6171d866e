"""Text -> token ids for the encoder executors, safe to call from several threads at once.

    TextTokenizer(tokenizer, max_length, model_name, vocab_size, lower_case)
      .tokenize(texts, truncate)      ids with the model's special tokens; too long -> InvalidInput
      .tokenize_ids(ids, truncate)    client-supplied ids, validated and wrapped in the special tokens
      .token_ids(text, specials)      what /tokenize answers (no length check)
      .detokenize(ids)                what /detokenize answers (special tokens kept)

The fast tokenizer's Rust backend is called directly, from a copy set to neither truncate nor pad:
a fast tokenizer called from several threads with changing settings mutates shared state ("Already
borrowed"), and the transformers wrapper around the backend costs per call about as much as
tokenising a short query. Truncation is done here (keeping the closing special token). A slow
tokenizer falls back to the wrapper with fixed settings. ``InvalidInput`` is the error an input the
model cannot take raises, here and in the cross-encoder's pair tokenising.
"""

from __future__ import annotations

import copy
from typing import Any


class InvalidInput(ValueError):
    """An input the model cannot take (too many tokens, a token id outside the vocabulary), raised by its
    executor's ``tokenize``; the message is written for the client, and the server answers it with a 400
    (``server/service.py``). ``code`` is the OpenAI error code."""

    def __init__(self, message: str, code: str = "invalid_input") -> None:
        super().__init__(message)
        self.code = code


class TextTokenizer:
    def __init__(self, tokenizer: Any, max_length: int, model_name: str, vocab_size: int,
                 lower_case: bool = False) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.model_name = model_name
        self.lower_case = lower_case
        self.backend = plain_backend(tokenizer)
        self.vocab_size = vocab_size  # the model's embedding rows: what an id is checked against
        self.specials = self._special_tokens()

    @property
    def num_special_tokens(self) -> int:
        """Tokens ``tokenize`` adds around every text (2 for BERT: [CLS] ... [SEP])."""
        return len(self.specials[0]) + len(self.specials[1])

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids with special tokens. Too long and not ``truncate`` -> InvalidInput (HTTP 400)."""
        ids = self._encode(texts, add_special_tokens=True)
        if truncate:
            tail = self.specials[1]
            ids = [r if len(r) <= self.max_length else r[: self.max_length - len(tail)] + tail for r in ids]
        return self.check_lengths(ids)

    def tokenize_ids(self, inputs: list[list[int]], truncate: bool = False,
                     prefix: list[int] | None = None) -> list[list[int]]:
        """Client-supplied token ids (OpenAI ``input`` as integer lists): validated, wrapped in the
        special tokens unless they already are, ``prefix`` (a prompt's ids) after the leading ones,
        truncated (keeping the prefix and the closing token) if asked."""
        head, tail = self.specials
        prefix = list(prefix or [])
        out: list[list[int]] = []
        for i, ids in enumerate(inputs):
            ids = self.check_vocab(ids, f"input {i}")
            wrapped = len(ids) >= len(head) + len(tail) and ids[: len(head)] == head and (
                not tail or ids[-len(tail):] == tail)
            body = ids[len(head) : len(ids) - len(tail)] if wrapped else ids
            if truncate:
                body = body[: max(self.max_length - len(head) - len(prefix) - len(tail), 0)]
            out.append(head + prefix + body + tail)
        return self.check_lengths(out)

    def token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode([text], add_special_tokens)[0]

    def detokenize(self, ids: list[int]) -> str:
        ids = self.check_vocab(ids, "tokens")
        if self.backend is not None:
            return str(self.backend.decode(ids, skip_special_tokens=False))
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def check_vocab(self, ids: list[int], what: str) -> list[int]:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInput(f"{what}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               code="invalid_token_id")
        return ids

    def check_lengths(self, ids: list[list[int]]) -> list[list[int]]:
        for i, row in enumerate(ids):
            if len(row) > self.max_length:
                raise InvalidInput(f"input {i} has {len(row)} tokens but {self.model_name} accepts at most "
                                   f"{self.max_length}; shorten it or ask for truncation",
                                   code="context_length_exceeded")
        return [list(r) for r in ids]

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if self.lower_case:
            texts = [t.lower() for t in texts]
        if self.backend is not None:
            return [list(e.ids) for e in self.backend.encode_batch(list(texts),
                                                                   add_special_tokens=add_special_tokens)]
        out = self.tokenizer(list(texts), add_special_tokens=add_special_tokens, truncation=False,
                             verbose=False, return_attention_mask=False, return_token_type_ids=False)
        return [list(x) for x in out["input_ids"]]

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text ([CLS] / [SEP], <s> / </s>...), learned
        from the tokenizer itself so any model's template works."""
        body = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        start = next(i for i in range(len(full)) if full[i : i + len(body)] == body)
        return list(full[:start]), list(full[start + len(body) :])


def plain_backend(tokenizer: Any) -> Any:
    """The fast tokenizer's Rust backend set to neither truncate nor pad, or None for a slow
    tokenizer. A copy: the wrapper keeps its own settings."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    backend = copy.deepcopy(backend)
    backend.no_truncation()
    backend.no_padding()
    return backend
