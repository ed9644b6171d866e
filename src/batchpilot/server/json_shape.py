"""How many JSON values and containers a raw body holds, counted without parsing it.

``json.loads`` turns three bytes of ``{},`` into a 64-byte dict, and pydantic then builds an error
object per bad item: a 16 MiB body of ``[{}, {}, ...]`` costs hundreds of MB before the first error is
read. The request middleware refuses a body whose structure is over the limits before anything parses
it. It counts commas and ``{`` / ``[`` outside strings with vectorised byte comparisons in 1 MiB
pieces (numpy releases the GIL, so a large body is scanned in a worker thread without stalling the
event loop); for valid JSON the value count is an upper bound, exact but for empty containers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_CHUNK = 1 << 20
EARLY_SCAN_BYTES = 1 << 20  # a body still arriving is scanned on the loop only up to this size
_QUOTE, _BACKSLASH, _COMMA, _LBRACE, _LBRACKET = 0x22, 0x5C, 0x2C, 0x7B, 0x5B


@dataclass(frozen=True)
class JSONShape:
    values: int  # scalars and containers outside strings: commas + containers + 1 (an upper bound)
    containers: int  # objects and arrays


def json_shape(body: bytes | bytearray) -> JSONShape:
    """The counts for ``body`` (UTF-8 JSON; any bytes give some bound)."""
    values = containers = 0
    inside = 0  # 1 while the scan is inside a string, carried across pieces
    start, n = 0, len(body)
    while start < n:
        end = min(n, start + _CHUNK)
        while end < n and body[end - 1] == _BACKSLASH:  # never split an escape
            end += 1
        part = body[start:end]
        if b"\\" in part:  # drop escaped backslashes and quotes: every quote left delimits a string
            part = part.replace(b"\\\\", b"").replace(b'\\"', b"")
        a = np.frombuffer(part, dtype=np.uint8)
        if a.size:
            parity = (np.cumsum(a == _QUOTE, dtype=np.uint8) + np.uint8(inside)) & 1
            outside = parity == 0
            containers += int(np.count_nonzero(((a == _LBRACE) | (a == _LBRACKET)) & outside))
            values += int(np.count_nonzero((a == _COMMA) & outside))
            inside = int(parity[-1])
        start = end
    return JSONShape(values=values + containers + (1 if n else 0), containers=containers)


def over_limits(shape: JSONShape, max_containers: int, max_values: int) -> str | None:
    if shape.containers > max_containers:
        return f"more than {max_containers} JSON objects and arrays"
    if shape.values > max_values:
        return f"more than {max_values} JSON values"
    return None


class ShapeWatch:
    """The JSON structure limits, watched while a body arrives (the request middleware feeds it).

    Counting ``{ [ ,`` in the raw bytes (``bytes.count``: C speed) bounds the real counts from above
    (some may sit inside strings), so nothing more is done while the raw counts are within the limits
    (``suspect`` stays False: the finished body needs no scan). Once they are over, the string-aware
    scan (``json_shape``) of what has arrived decides, at doubling sizes up to ``EARLY_SCAN_BYTES``
    (on the event loop, so bounded): a structure bomb is refused after its first few hundred KB
    instead of after all 16 MiB. A larger suspect body is scanned whole once it is in (in a thread)."""

    def __init__(self, max_containers: int, max_values: int) -> None:
        self.max_containers, self.max_values = max_containers, max_values
        self.containers = self.values = 0
        self.suspect = False
        self.over: str = ""
        self._next_scan = 0

    def feed(self, chunk: bytes, body: bytearray) -> bool:
        """False when what has arrived is already over a limit (``over`` says which)."""
        if not self.suspect:
            self.containers += chunk.count(b"{") + chunk.count(b"[")
            self.values += chunk.count(b",")
            self.suspect = (self.containers > self.max_containers
                            or self.values + self.containers + 1 > self.max_values)
        if not self.suspect or len(body) < self._next_scan or len(body) > EARLY_SCAN_BYTES:
            return True
        self._next_scan = 2 * len(body)
        over = over_limits(json_shape(body), self.max_containers, self.max_values)
        if over is None:
            return True
        self.over = over
        return False
