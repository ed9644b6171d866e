"""Several live servers measured in one run, taking turns: the fair way to compare them here.

The CPU's speed moves by tens of percent within minutes on a shared machine, so servers measured one
after the other are not compared on the same machine. ``interleaved_capacity`` runs one capacity
search per server (``bench.capacity.live_capacity``), each in its own thread, and lets exactly one
probe run at a time, in round-robin order: server A's first probe, B's first, A's second, ... Every
server gets the same probe length, the same rows, the same SLA and the same number of probes, so
each is given the same chance; a search that finishes early drops out of the rotation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from batchpilot.bench.capacity import CapacityConfig, CapacityResult, live_capacity
from batchpilot.bench.loadgen import KEEPALIVE_EXPIRY_S, LoadGenConfig
from batchpilot.sim.traces import Workload


class Turns:
    """Round-robin turn-taking among named parties: ``with turns.turn(name):`` waits for ``name``'s turn."""

    def __init__(self, names: Sequence[str]) -> None:
        self._order = list(names)
        self._active = set(names)
        self._next = 0
        self._cond = threading.Condition()

    def _current(self) -> str | None:
        for i in range(len(self._order)):
            name = self._order[(self._next + i) % len(self._order)]
            if name in self._active:
                self._next = (self._next + i) % len(self._order)
                return name
        return None

    @contextmanager
    def turn(self, name: str) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._current() == name)
        try:
            yield
        finally:
            with self._cond:
                self._next = (self._order.index(name) + 1) % len(self._order)
                self._cond.notify_all()

    def done(self, name: str) -> None:
        with self._cond:
            self._active.discard(name)
            self._cond.notify_all()


def interleaved_capacity(workload: Workload, urls: dict[str, str], config: CapacityConfig,
                         texts: list[str], starts: dict[str, float] | None = None,
                         log: Any = print, keepalive_s: float = KEEPALIVE_EXPIRY_S
                         ) -> dict[str, CapacityResult]:
    """A capacity search per server at ``urls[name]``, probes interleaved (one at a time, round-robin).
    ``starts[name]`` is each search's first rate scale (e.g. its predicted capacity); ``keepalive_s``:
    the load generator's ``LoadGenConfig.keepalive_s``."""
    turns = Turns(list(urls))
    results: dict[str, CapacityResult] = {}
    errors: list[BaseException] = []

    def search(name: str, url: str) -> None:
        cfg = replace(config, start=min(max(starts.get(name, config.start) if starts else config.start,
                                            config.lo), config.hi))
        try:
            results[name] = live_capacity(
                workload, LoadGenConfig(url, progress=False, keepalive_s=keepalive_s), cfg, texts=texts,
                on_probe=lambda p: log(f"  {name}: x{p.rate_scale:.3f} P99 {p.summary.p99 * 1e3:.0f} ms "
                                       f"{'pass' if p.passed else 'FAIL'}"),
                turn=lambda: turns.turn(name))
        except BaseException as exc:  # reported after the others finish
            errors.append(exc)
        finally:
            turns.done(name)

    threads = [threading.Thread(target=search, args=(n, u), name=f"capacity-{n}") for n, u in urls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
