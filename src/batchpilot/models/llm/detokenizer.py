"""Token ids to streamed text, one token at a time, with stop strings.

Two offsets (TGI's scheme): decode ``ids[prefix:read]`` and ``ids[prefix:]`` and emit the difference,
so byte-level BPE tokens that split a UTF-8 character (or merge with a neighbour's leading space)
never produce garbage; an incomplete character (``\\ufffd`` at the end) waits for the next token.

With stop strings, the last ``longest - 1`` characters are held back until they can no longer begin a
stop string, so no part of a stop string is ever emitted, and the text ends right before the first
match (OpenAI semantics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def make_decode(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """``ids -> text`` skipping special tokens; the Rust tokenizer directly when it is equivalent
    (~4x less overhead per call than HF's Python wrapper, measured), else ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: str(backend.decode(list(ids), skip_special_tokens=True)) if ids else ""
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)) if ids else ""


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # with stop strings: all text so far, of which ``emitted`` characters were sent
        self.emitted = 0

    def step(self, ids: Sequence[int]) -> tuple[str, bool]:
        """``ids``: all output tokens including the new one. Returns (text to emit, stop string hit)."""
        prefix = self.decode(ids[self.prefix_offset : self.read_offset])
        full = self.decode(ids[self.prefix_offset :])
        delta = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        if not self.stop:
            return delta, False
        old = len(self.text)
        self.text += delta
        scan_from = max(0, old - self.longest + 1)
        cut = min((i for i in (self.text.find(s, scan_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            end = max(cut, self.emitted)
            out, self.emitted = self.text[self.emitted : end], end
            return out, True
        safe = max(self.emitted, len(self.text) - self.longest + 1)
        out, self.emitted = self.text[self.emitted : safe], safe
        return out, False

    def flush(self, ids: Sequence[int]) -> str:
        """Everything not emitted yet, at the end of a sequence that did not stop on a stop string."""
        prefix = self.decode(ids[self.prefix_offset : self.read_offset])
        full = self.decode(ids[self.prefix_offset :])
        tail = full[len(prefix) :] if len(full) > len(prefix) else ""
        if not self.stop:
            return tail
        self.text += tail
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
