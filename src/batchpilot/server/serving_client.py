"""The serving-path profile's client: a process of its own, placed where ``bench`` places its load generator.

A client inside the profiler's process shares its cores and its interpreter with the server it
measures, and never waits on another core; the live load generator (``bench``, ``bench fidelity``) is
another process on the cores the server is not pinned to, and between two requests both sides sleep.
What a request costs outside the batcher depends on both. So the profile sends its traffic from a
child process (``multiprocessing`` spawn) on ``other_cores`` (all cores when this process is pinned to
none), and reports back what it saw:

* ``send_elsewhere``: a plan replayed open-loop at its times (the loaded phase); returns the child's
  CPU seconds, whether it shared this process's cores, and per answered request a
  ``serving_delay.DelayRow`` tuple;
* ``lone_elsewhere``: a plan sent strictly one request at a time with ``gap_s`` of silence between
  two (the lone requests of ``serving_profile``: each one alone in the server, none queued); returns
  every request's ``RequestRecord``.

A child that dies before it reports is a ``RuntimeError`` that says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest

LONE_GAP_S = 0.2  # silence between two lone requests: both sides sleep, as between a live server's requests
CHILD_TIMEOUT_S = 600.0  # the most a child's traffic may take before the profile gives up on it


def send_elsewhere(url: str, model: str, plan: Sequence[PlannedRequest],
                   endpoint: str = "embeddings") -> tuple[float, bool, list[Any]]:
    """Replay ``plan`` open-loop from a child process on the cores this one is not pinned to (if any).
    Returns the child's CPU seconds while it replayed (its start-up, before the first request, is
    not traffic), whether it ran on this process's cores, and per answered request ``(index,
    scheduled_s, latency_s, server_tokenize_s, server_batcher_s, input_tokens)``
    (``serving_delay.DelayRow``)."""
    cpu, rows = _run_child(url, model, plan, endpoint, None)
    return float(cpu), other_cores() is None, rows


def lone_elsewhere(url: str, model: str, plan: Sequence[PlannedRequest], gap_s: float,
                   endpoint: str = "embeddings") -> list[Any]:
    """Send ``plan`` one request at a time, ``gap_s`` seconds apart (from one answer to the next
    request), from a child process placed as ``send_elsewhere``'s; every request's ``RequestRecord``
    in plan order."""
    if not gap_s >= 0:
        raise ValueError(f"serving path: the gap between lone requests must be >= 0 s, got {gap_s}")
    return list(_run_child(url, model, plan, endpoint, float(gap_s))[1])


def _run_child(url: str, model: str, plan: Sequence[PlannedRequest], endpoint: str,
               gap_s: float | None) -> tuple[float, list[Any]]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=replay_child, args=(url, model, list(plan), endpoint, send, gap_s),
                        daemon=True)
    child.start()
    send.close()
    try:
        cpu, rows = receive.recv() if receive.poll(CHILD_TIMEOUT_S) else (math.nan, [])
    except EOFError:  # the child ended without reporting: it failed
        cpu, rows = math.nan, []
    child.join(60)
    if child.exitcode != 0 or (gap_s is None and not math.isfinite(cpu)):
        raise RuntimeError(f"serving path: the load generator process exited with {child.exitcode}")
    return cpu, rows


def other_cores() -> set[int] | None:
    """The cores this process is not pinned to, where the load generator runs; None when it is
    pinned to none of them (it then shares this process's cores)."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        return None
    mine, every = os.sched_getaffinity(0), set(range(os.cpu_count() or 1))
    rest = every - mine
    return rest if rest and len(mine) < len(every) else None


def replay_child(url: str, model: str, plan: list[PlannedRequest], endpoint: str = "embeddings",
                 report: Any = None, gap_s: float | None = None) -> None:
    """The client process: on ``other_cores`` when there are any; ``gap_s`` None: ``replay`` open-loop
    and send the CPU seconds the replay took (all its threads) and its answered requests' rows;
    else one request at a time ``gap_s`` apart and send ``(nan, records)``. Sent to ``report`` (a
    pipe's end), if given."""
    import asyncio
    import os
    import time

    from batchpilot.bench.loadgen import one_by_one_async, replay
    from batchpilot.bench.serverproc import client_keepalive_s  # the in-process server keeps ServerConfig's

    rest = other_cores()
    if rest is not None:
        os.sched_setaffinity(0, rest)
    config = LoadGenConfig(url, endpoint, model=model, timeout_s=120.0,  # type: ignore[arg-type]
                           progress=False, scrape_interval_s=0, keepalive_s=client_keepalive_s())
    out: tuple[float, list[Any]]
    if gap_s is not None:
        out = (math.nan, asyncio.run(one_by_one_async(plan, config, gap_s=gap_s)))
    else:
        cpu0 = time.process_time()
        result = replay(plan, config)
        out = (time.process_time() - cpu0,
               [(float(r.index), r.scheduled_s, r.latency_s, r.server_tokenize_s, r.server_batcher_s,
                 float(r.input_tokens)) for r in result.records if r.ok and not r.warmup])
    if report is not None:
        report.send(out)
        report.close()
