"""How many requests Ray Serve may hand one replica at once (``max_ongoing_requests``), from the
resolved deployment's scheduler configs, and the check of a value the user gave. Pure: no Ray import."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.deployment import ServingOptions

# Ray Serve routes at most ``max_ongoing_requests`` HTTP requests to a replica at a time and queues the
# rest in its router or proxy (default 5). batchpilot's Batcher can only batch what it holds, so a
# replica must be allowed, per served model:
#
#     max_batch_size x num_slots        enough requests to fill a batch on every slot
#   + the queue the core allows         admission.max_concurrent_requests (what ``server.max_concurrency``
#                                       fills in), else admission.max_queued_requests, else the stated
#                                       default concurrency (``ServingOptions.max_concurrency``)
#
# summed over the models the replica serves. With it, every request past Ray's limit would also have
# been refused by the core, so what is admitted, queued and refused stays the core's decision.
#
# A value below ``max_batch_size x num_slots`` of some model would cap that model's batches below the
# configured size: ``check_max_ongoing`` refuses it with the numbers. A value between the two is allowed
# with a warning (Ray then queues work in front of the core's admission). Pure: no Ray import.

@dataclass(frozen=True)
class OngoingNeed:
    """What one model needs from ``max_ongoing_requests``: ``batches`` (max batch size x slots) and
    ``queue`` (what the core admits beyond them)."""

    name: str
    batches: int
    queue: int

    @property
    def total(self) -> int:
        return self.batches + self.queue


def need_of(name: str, config: SchedulerConfig) -> OngoingNeed:
    adm = config.admission
    queue = adm.max_concurrent_requests or adm.max_queued_requests or ServingOptions.max_concurrency
    return OngoingNeed(name, config.policy.max_batch_size * config.num_slots, queue)


def required_max_ongoing(configs: Sequence[tuple[str, SchedulerConfig]]) -> int:
    """The derived ``max_ongoing_requests``: every model's batches plus the queue its core allows."""
    return sum(need_of(name, cfg).total for name, cfg in configs)


def check_max_ongoing(explicit: int | None, configs: Sequence[tuple[str, SchedulerConfig]]
                      ) -> tuple[int, str | None]:
    """``(value to deploy with, warning or None)``; raises ``ValueError`` when ``explicit`` would cap a
    model's batches. ``explicit`` None: the derived value."""
    needs = [need_of(name, cfg) for name, cfg in configs]
    derived = sum(n.total for n in needs)
    if explicit is None:
        return derived, None
    if explicit < 1:
        raise ValueError(f"--max-ongoing-requests must be >= 1, got {explicit}")
    for n in needs:
        if explicit < n.batches:
            raise ValueError(
                f"--max-ongoing-requests {explicit} would cap model {n.name}'s batches: Ray Serve hands "
                f"a replica at most {explicit} requests at a time, but its deployment batches up to "
                f"{n.batches} (max_batch_size x num_slots). Give at least {n.batches}, or leave the flag "
                f"out to use the derived {derived} (batches plus the {n.queue} requests its core queues)")
    if explicit < derived:
        return explicit, (f"max_ongoing_requests {explicit} is below the derived {derived}: requests past "
                          f"{explicit} per replica wait in Ray's router, before batchpilot's admission")
    return explicit, None
