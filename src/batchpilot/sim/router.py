"""Router models: which replica of a fleet a request goes to, from what a load balancer can count.

    router = make_router("power_of_two", seed=0)
    k = router.choose(outstanding)      # outstanding[k]: requests sent to replica k and not answered

A router sees only the requests it has sent and not yet seen answered (refused and dropped ones are
answered too), as a load balancer or Ray Serve's handle does; it never reads a replica's queue, its
backlog or its clock. ``outstanding`` lists the replicas that take traffic now (a fleet that scales
passes only those) and ``choose`` returns a position in it.

* ``round_robin`` — in turn, whatever the load (nginx's default).
* ``least_loaded`` — the fewest outstanding requests, ties to the lowest position (join the shortest
  queue; nginx ``least_conn``, Envoy ``LEAST_REQUEST`` with all hosts compared).
* ``power_of_two`` — two distinct replicas drawn at random, the one with fewer outstanding requests,
  ties to the lower position (Mitzenmacher's power of two choices; Ray Serve's request router). The
  draws come from ``numpy.random.default_rng(seed)``: one seed, one sequence of choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

ROUTERS = ("round_robin", "least_loaded", "power_of_two")


class Router(Protocol):
    name: str

    def choose(self, outstanding: Sequence[int]) -> int:
        """The position in ``outstanding`` (requests in progress per replica) of the replica to use."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, outstanding: Sequence[int]) -> int:
        k = self._next % len(outstanding)
        self._next = k + 1
        return k


class LeastLoaded:
    name = "least_loaded"

    def choose(self, outstanding: Sequence[int]) -> int:
        best = 0
        low = outstanding[0]
        for k in range(1, len(outstanding)):
            if outstanding[k] < low:
                best, low = k, outstanding[k]
        return best


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._u: list[float] = []

    def choose(self, outstanding: Sequence[int]) -> int:
        n = len(outstanding)
        if n == 1:
            return 0
        if len(self._u) < 2:
            self._u = self._rng.random(4096).tolist()
        u = self._u
        a = min(int(u.pop() * n), n - 1)
        b = min(int(u.pop() * (n - 1)), n - 2)
        if b >= a:
            b += 1  # uniform over the other n - 1 replicas
        first, second = (a, b) if a < b else (b, a)
        return second if outstanding[second] < outstanding[first] else first


def make_router(name: str, seed: int = 0) -> Router:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"router {name!r}; choose one of {', '.join(ROUTERS)}")
