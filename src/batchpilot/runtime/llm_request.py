"""One request's sequence as both sides of the engine see it.

The engine thread delivers outputs (or the exception that ends the sequence) with ``put``; the asyncio
caller iterates the request. ``close()`` ends it from the caller's side: a sequence not yet finished is
aborted and its KV blocks freed. Either way ``on_done`` runs once, on the caller's side, when the
request stops counting against the engine's queue bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from collections.abc import Sequence as Items

from batchpilot.core.llm_admission import LLMAdmission
from batchpilot.core.sequence import Sequence
from batchpilot.models.llm.detokenizer import IncrementalDetokenizer
from batchpilot.runtime.llm_errors import refused
from batchpilot.runtime.llm_records import GenerationOutput


class LLMRequest:
    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[int], None], on_done: Callable[[], None]) -> None:
        self.seq = seq
        self.detok = detok
        self.last_t: float | None = None  # engine side: when its last token left a step
        self._loop = loop
        self._q: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        self._abort = abort
        self._on_done = on_done
        self._ended = False  # the engine will deliver nothing more
        self._released = False

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def deadline(self) -> float | None:
        """The sequence's deadline (engine clock, ``time.monotonic``; None: none)."""
        return self.seq.deadline

    # -- engine thread -----------------------------------------------------------------------
    def put(self, item: GenerationOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)

    # -- caller (event loop) -----------------------------------------------------------------
    def __aiter__(self) -> LLMRequest:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finish_reason is not None:
            self._end()
        return item

    def close(self) -> None:
        """Stop caring about the answer: abort the sequence unless it has finished. Idempotent."""
        if not self._ended:
            self._abort(self.seq.seq_id)
        self._end()

    def _end(self) -> None:
        self._ended = True
        if not self._released:
            self._released = True
            self._on_done()


def admit_requests(admission: LLMAdmission, seqs: list[Sequence], decode: Callable[[Items[int]], str],
                   stop: Items[str], loop: asyncio.AbstractEventLoop,
                   abort: Callable[[int], None], on_done: Callable[[], None]) -> list[LLMRequest]:
    """The handles of one request's sequences, once the core admits them together (``admission.admit``);
    a refusal raises its error (``llm_errors.refused``). The engine and the static fallback both call it,
    under their own lock."""
    refusal = admission.admit(seqs)
    if refusal is not None:
        raise refused(refusal)
    return [LLMRequest(seq, IncrementalDetokenizer(decode, stop), loop, abort, on_done) for seq in seqs]
