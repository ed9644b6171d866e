"""One request as the failover hands it out: the main engine's sequence, or the fallback's after a fault.

Iterated like an ``LLMRequest``. When the engine under it fails (``EngineStopped`` from a dead, stalled
or retired engine; ``GenerationFailed`` caused by an out-of-memory error) the failover hears of the
fault, and the request moves to the fallback engine if nothing of it has reached the client yet:

* a streamed request, before its first output (the route awaits that before the response starts);
* a ``replayable`` request (not streamed) at any point: it collects every output before handing any
  out, so a fault mid-way restarts it on the fallback from its prompt and the client sees one answer.

Otherwise (a stream already under way, no fallback, the fallback failing too) the failure reaches the
client as ``EngineUnavailable``; a failure that is not the engine's (a model error on this input, a
deadline) reaches it as it is. Either way the request is answered once.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from batchpilot.core.sequence import SamplingParams
from batchpilot.runtime.llm_errors import EngineStopped, EngineUnavailable, GenerationFailed
from batchpilot.runtime.llm_records import GenerationOutput
from batchpilot.runtime.llm_watchdog import DIED, OUT_OF_MEMORY

if TYPE_CHECKING:
    from batchpilot.runtime.llm_failover import LLMFailover


class FailoverRequest:
    def __init__(self, owner: LLMFailover, prompt: list[int], params: SamplingParams, priority: int,
                 deadline: float | None, inner: Any, engine: Any, replayable: bool) -> None:
        self.owner, self.prompt, self.params = owner, prompt, params
        self.priority, self.deadline = priority, deadline
        self.inner, self.engine = inner, engine  # the LLMRequest and the engine it is on
        self.replayable = replayable
        self._ready: deque[GenerationOutput] | None = None  # replayable: the whole answer, once complete
        self._handed_out = False
        self.moves = 0  # times moved to a fallback

    @property
    def seq_id(self) -> int:
        return int(self.inner.seq_id)

    def __aiter__(self) -> FailoverRequest:
        return self

    async def __anext__(self) -> GenerationOutput:
        if not self.replayable:
            item = await self._next()
            self._handed_out = True
            return item
        if self._ready is None:
            self._ready = deque(await self._whole())
        if not self._ready:
            raise StopAsyncIteration
        return self._ready.popleft()

    async def _whole(self) -> list[GenerationOutput]:
        items: list[GenerationOutput] = []
        while True:
            moves = self.moves
            try:
                item = await self._next()
            except StopAsyncIteration:
                return items
            if self.moves != moves:
                items.clear()  # restarted on the fallback: what the failed engine gave is dropped
            items.append(item)
            if item.finish_reason is not None:
                return items

    async def _next(self) -> GenerationOutput:
        while True:  # after a move, the next output comes from the fallback
            try:
                item: GenerationOutput = await self.inner.__anext__()
                return item
            except (EngineStopped, GenerationFailed) as exc:
                if not self._move(exc):
                    raise self._for_client(exc) from None

    def _kind(self, exc: BaseException) -> str | None:
        if isinstance(exc, GenerationFailed):
            return OUT_OF_MEMORY if exc.out_of_memory else None
        return DIED

    def _move(self, exc: BaseException) -> bool:
        """Report the engine's fault; move to the fallback if the client has seen nothing yet."""
        kind = self._kind(exc)
        if kind is None or self.owner.closing:
            return False
        self.owner.report(self.engine, kind)
        if self._handed_out or self.engine is self.owner.fallback:
            return False
        moved = self.owner.resubmit(self)
        if moved is None:
            return False
        self.inner.close()
        self.inner, self.engine = moved, self.owner.fallback
        self.moves += 1
        return True

    def _for_client(self, exc: BaseException) -> BaseException:
        if self._kind(exc) is None or self.owner.closing:
            return exc
        return EngineUnavailable(retry_after_s=self.owner.retry_after_s())

    def close(self) -> None:
        self.inner.close()
