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
