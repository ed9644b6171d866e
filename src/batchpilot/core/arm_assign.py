"""Which arm of a rollout a request lands on: a stable hash of its client key, else a uniform draw,
in the arms' slices of [0, 1) (``core/rollout.py`` has the whole contract)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def key_point(key: str) -> float:
    """Where a client key falls in [0, 1): a stable hash (the same in every process and run)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def arm_for(key: str | None, shares: Sequence[float], draw: float) -> int:
    """The arm whose slice holds the key's point (or ``draw`` without a key); the primary (0) when the
    point falls past every slice (shares adding up to less than 1 after a rollback)."""
    point = key_point(key) if key is not None else draw
    total = 0.0
    for i, share in enumerate(shares):
        total += share
        if point < total:
            return i
    return 0
