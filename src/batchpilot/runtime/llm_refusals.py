"""What an LLM engine refused, by reason: the counts ``batchpilot_llm_rejected_requests{reason}`` reads.

The reasons are the error codes of the answers (``core/llm_admission.py``), one count per request:

* ``context_length_exceeded`` (400) and ``queue_full`` (503): the core's admission refusals,
  ``LLMAdmission.refused``. ``admit`` counts them; a full engine found by ``check_room`` (the routes ask
  before tokenising) is counted by the engine into the same count, so each refused request counts once.
* ``timeout`` (504, or the timeout error event of a stream already under way): a request whose
  sequences the engine ended at their deadline (``past_deadline``): expired by the engine
  (``LLMScheduler.expire``; the static fallback by the same test), or aborted by the routes once it
  had passed.

The engine's counts live in ``LLMCounters.refused``, the ``Counter`` its admission counts into: an
engine rebuilt on another's counters (``llm_failover.rebuild``) counts on from them. The static
fallback counts in its admission's, which ``restarted`` hands on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from batchpilot.core.llm_admission import NEVER_FITS, QUEUE_FULL, TIMEOUT, LLMAdmission
from batchpilot.core.sequence import Sequence
from batchpilot.runtime.llm_errors import EngineStopped, refused
from batchpilot.runtime.llm_records import EngineCounters

REASONS = (NEVER_FITS, QUEUE_FULL, TIMEOUT)


@dataclasses.dataclass
class LLMCounters(EngineCounters):
    """The engine's running totals, with the requests it refused by reason (``REASONS``)."""

    refused: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class LateRequests:
    """Counts each request that ended at its deadline once, however many of its sequences end there.

    The sequences of one request share their ``arrival`` and ``deadline`` (one ``submit``), so that pair
    names the request; the last ``keep`` requests counted are remembered (the sequences of one request
    reach their end within a step or a batch of each other)."""

    def __init__(self, lock: threading.Lock, keep: int = 1024) -> None:
        self._lock = lock  # the lock the admission counts under
        self._keep = keep
        self._seen: dict[tuple[float, float | None], None] = {}

    def count(self, seq: Sequence, refused: collections.Counter[str]) -> None:
        """``seq`` ended at its deadline: count its request under ``TIMEOUT`` unless it is counted."""
        key = (seq.arrival, seq.deadline)
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > self._keep:
            del self._seen[next(iter(self._seen))]
        with self._lock:
            refused[TIMEOUT] += 1


class AdmissionFront:
    """The caller's side of an engine's admission (``LLMEngine``, ``StaticFallback``): the room check
    the routes make before tokenising, counted as a refusal when it refuses, and the release of a done
    sequence. The engine sets ``admission`` and the ``_lock`` it is used under."""

    admission: LLMAdmission
    _lock: threading.Lock

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    @property
    def num_pending(self) -> int:
        """Sequences admitted and not yet done (what the queue bound counts)."""
        return self.admission.num_admitted

    def check_room(self, n: int = 1) -> None:
        """Raise ``EngineStopped`` or ``EngineBusy`` if ``n`` more sequences would be refused now: the
        cheap check a server makes before it spends time tokenising them. A refusal here is the
        request's answer, so it counts in ``admission.refused`` as one by ``admit`` would."""
        if not self.is_alive:
            raise EngineStopped
        with self._lock:
            refusal = self.admission.room(n)
            if refusal is not None:
                self.admission.refused[refusal.reason] += 1
        if refusal is not None:
            raise refused(refusal)

    def _release(self) -> None:
        with self._lock:
            self.admission.release()
