"""Structured outputs: a request's constraint as a grammar, one matcher per sequence, a token mask a step.

    grammars_for(tokenizer, vocab_size, eos_ids)  -> the one ``Grammars`` of that tokenizer (made once)
    Grammars(tokenizer, vocab_size, eos_ids)   compiles a ``StructuredOutput`` (``core/llm/sequence.py``)
        .compile(constraint)                    -> a compiled grammar (cached by the compiler), or
                                                   ``GrammarRefused`` with the library's reason (the 400)
    Constraints(make_grammars)                  the matchers of the sequences that have a constraint
        .masks(seqs)                            -> (bitmask, rows): the masks of the rows that have one
        .accept(seq, token)                     advance a sequence's matcher by the token it was given
        .forget(seq_id)

The library is xgrammar, chosen by measurement against llguidance on the built-in tokenizer (the mask of
one step, median and worst over a JSON answer, was smaller; its compile time larger, and compiled
grammars are cached). A matcher's state is a function of the sequence's output tokens alone: it is made
on the sequence's first masked step and replays the outputs it finds (a sequence moved to a rebuilt
engine), and neither preemption (recompute or swap keeps the outputs) nor a KV copy changes it, so
nothing needs rolling back. The masks are filled on the engine thread when the step's tokens are chosen,
after the forward is launched (on a GPU its kernels run meanwhile), all rows in one call
(``BatchGrammarMatcher``). Measured on 2 cores: one row's mask takes ~20 us, but a matcher's own fill
releases the GIL and waits to take it back behind any busy thread (the event loop: ~30 ms a step of 16
rows on a conv-llm slice), as a worker thread filling during the CPU forward waits behind the forward's
Python; the one batched call does neither.

JSON answers are compact (no whitespace between tokens: ``any_whitespace=False``, separators ``,`` and
``:``), as a random or small model would otherwise fill the answer with whitespace; ``json_object`` is
any JSON object. Two masks of our own close what xgrammar leaves open (``Grammars.valid_utf8``,
``json_safe``, ``after_ed``): no answer holds a UTF-16 surrogate's bytes, no JSON answer a raw control
character.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from batchpilot.core.llm.sequence import Sequence, StructuredOutput

COMPACT = (",", ":")  # JSON separators: no whitespace at all
JSON_KINDS = ("json_schema", "json_object")
SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


class GrammarRefused(ValueError):
    """The constraint cannot be compiled: its text is the library's reason (answered as a 400)."""


class Grammars:
    """One tokenizer's grammar compiler (xgrammar), imported on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Seq[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(eos_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)  # fills a step's masks in one call
        self.token_bytes: list[bytes] = list(self.info.decoded_vocab)  # the property rebuilds it per read
        self._lock = threading.Lock()  # the routes compile on their pool, the engine on its thread

    def compile(self, c: StructuredOutput) -> Any:
        try:
            with self._lock:
                return self._compile(c)
        except GrammarRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - the library's own error types vary by kind
            raise GrammarRefused(f"{c.kind}: {_first_line(exc)}") from None

    def _compile(self, c: StructuredOutput) -> Any:
        cc = self.compiler
        if c.kind == "json_schema":
            try:
                json.loads(c.spec)
            except ValueError as exc:
                raise GrammarRefused(f"json_schema: not valid JSON ({exc})") from None
            return cc.compile_json_schema(c.spec, any_whitespace=False, separators=COMPACT)
        if c.kind == "json_object":
            return cc.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=COMPACT)
        if c.kind == "regex":
            return cc.compile_regex(c.spec)
        if c.kind == "choice":
            return cc.compile_grammar(choice_grammar(c.spec))
        return cc.compile_grammar(c.spec)

    def matcher(self, c: StructuredOutput) -> Any:
        return self.xgr.GrammarMatcher(self.compile(c))

    # Two masks xgrammar's own leave out, ANDed into a constrained row's (``Constraints._fill``). Its
    # UTF-8 decoding takes the encodings of the surrogates U+D800-U+DFFF (bytes ED A0-BF ..), which no
    # decoder does (each byte becomes U+FFFD: a bounded string grows past its maxLength), and its JSON
    # string rule under ``maxLength`` admits raw control characters, which compact JSON never holds.
    @functools.cached_property
    def valid_utf8(self) -> torch.Tensor:
        """The tokens whose bytes hold no surrogate's encoding (and the stop tokens)."""
        return self._mask(lambda b: not SURROGATE.search(b))

    @functools.cached_property
    def json_safe(self) -> torch.Tensor:
        """``valid_utf8`` less the tokens holding a control character (U+0000-U+001F)."""
        return self._mask(lambda b: not SURROGATE.search(b) and not any(x < 0x20 for x in b))

    @functools.cached_property
    def after_ed(self) -> torch.Tensor:
        """The tokens that may follow a lone trailing byte ED: none that begins with A0-BF."""
        return self._mask(lambda b: not 0xA0 <= b[0] <= 0xBF)

    def _mask(self, allowed: Callable[[bytes], bool]) -> torch.Tensor:
        stops = set(self.info.stop_token_ids)
        ids = [i for i, b in enumerate(self.token_bytes[: self.vocab_size])
               if i in stops or (b and allowed(b))]
        bits = torch.zeros(self.bitmask(1).shape[1] * 32, dtype=torch.int64)
        bits[torch.tensor(ids, dtype=torch.int64)] = 1
        packed = (bits.view(-1, 32) * 2 ** torch.arange(32, dtype=torch.int64)).sum(dim=1)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def ends_in_ed(self, token: int) -> bool:
        """The token's bytes end with a lone ED (a 3-byte character's first byte)."""
        b = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""
        return b.endswith(b"\xed")

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)


@functools.lru_cache(maxsize=8)
def grammars_for(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> Grammars:
    """The grammar compiler of a tokenizer, shared by everything that serves it (the routes check a
    constraint with it, each engine's sampler masks with it): one compiled-grammar cache."""
    return Grammars(tokenizer, vocab_size, eos_ids)


def choice_grammar(spec: str) -> str:
    """An EBNF grammar matching exactly one of the strings of the JSON list ``spec``."""
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise GrammarRefused(f"choice: not a JSON list of strings ({exc})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(x, str) and x for x in choices):
        raise GrammarRefused("choice: give a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(x) for x in choices)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


class Constraints:
    """The matchers of constrained sequences, keyed by sequence id, and their masks for a step."""

    def __init__(self, make_grammars: Callable[[], Grammars]) -> None:
        self._make_grammars = make_grammars  # called on the first constrained sequence
        self._matchers: dict[int, Any] = {}

    @functools.cached_property
    def grammars(self) -> Grammars:
        return self._make_grammars()

    def _matcher(self, seq: Sequence) -> Any:
        m = self._matchers.get(seq.seq_id)
        if m is None:
            assert seq.params.structured is not None
            m = self._matchers[seq.seq_id] = self.grammars.matcher(seq.params.structured)
            for token in seq.output_token_ids:  # a sequence that already has outputs (a rebuilt engine)
                if not m.accept_token(token):
                    break
        return m

    def masks(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of ``seqs``' rows (filled for the constrained ones that have not terminated) and
        those rows' indices; None when no row is constrained."""
        if not any(s.params.structured is not None for s in seqs):
            return None
        out = self._fill(list(seqs))
        return out if out[1] else None

    def _fill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        rows = [i for i, s in enumerate(seqs) if s.params.structured is not None]
        live = [i for i in rows if not self._matcher(seqs[i]).is_terminated()]
        bitmask, g = self.grammars.bitmask(len(seqs)), self.grammars
        if live:  # one call: a matcher's own fill drops and retakes the GIL, each time behind other threads
            g.batch.batch_fill_next_token_bitmask([self._matchers[seqs[i].seq_id] for i in live], bitmask,
                                                  indices=live)
        for i in live:
            seq = seqs[i]
            bitmask[i] &= g.json_safe if seq.params.structured.kind in JSON_KINDS else g.valid_utf8  # type: ignore[union-attr]
            if seq.output_token_ids and g.ends_in_ed(seq.output_token_ids[-1]):
                bitmask[i] &= g.after_ed
        return bitmask, live

    def accept(self, seq: Sequence, token: int) -> None:
        m = self._matchers.get(seq.seq_id)
        if m is not None and not m.is_terminated():
            m.accept_token(token)

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
