"""Byte sizes as people write them: ``parse_bytes("4GiB")``, ``"512MiB"``, ``"1.5GB"``, ``"1e9"``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float, default_unit: str = "") -> int:
    """Bytes in ``text``: a number with an optional unit (B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB
    powers of 1024, case-insensitive); a bare number is in ``default_unit`` (bytes unless given).
    Raises ``ValueError`` naming the accepted forms."""
    if isinstance(text, (int, float)):
        return int(text * _UNITS[default_unit.lower()])
    m = _SIZE.match(text)
    unit = (m.group(2) if m else "").lower() or default_unit.lower()
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write a number with an optional unit, e.g. 4GiB, "
                         f"512MiB, 2GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[unit])
