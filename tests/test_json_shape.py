"""The JSON structure counts and the watch that refuses a structure bomb while it arrives."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.server.middleware import ShapeWatch, json_shape

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='{}[],"\\ab'),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                               max_size=4),
                    max_leaves=30)


def _real(value: object) -> tuple[int, int]:
    """(containers, values): every container and scalar is a value; object keys are not."""
    children = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else None
    if children is None:
        return 0, 1
    parts = [_real(v) for v in children]
    return 1 + sum(p[0] for p in parts), 1 + sum(p[1] for p in parts)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_counts_are_exact_containers_and_an_upper_bound_on_values(value: object) -> None:
    containers, values = _real(value)
    shape = json_shape(json.dumps(value).encode())
    assert shape.containers == containers
    assert shape.values >= values


def feed_all(watch: ShapeWatch, body: bytes, piece: int = 65536) -> int | None:
    """Feed ``body`` in pieces; the bytes received when the watch refused, or None."""
    got = bytearray()
    for i in range(0, len(body), piece):
        chunk = body[i:i + piece]
        got += chunk
        if not watch.feed(chunk, got):
            return len(got)
    return None


def test_a_structure_bomb_is_refused_after_its_first_few_hundred_kilobytes() -> None:
    bomb = b'{"input": [' + b"{}," * (5 * 1024 * 1024) + b"{}]}"
    at = feed_all(ShapeWatch(max_containers=65536, max_values=2_097_152), bomb)
    assert at is not None and at < 512 * 1024


def test_braces_inside_strings_are_not_a_bomb() -> None:
    text = json.dumps({"input": ["{[," * 100_000]}).encode()  # 300 k braces and commas, all in a string
    watch = ShapeWatch(max_containers=65536, max_values=2_097_152)
    assert feed_all(watch, text) is None
    assert watch.suspect  # the raw counts were over: the finished body is scanned whole


def test_an_ordinary_body_is_never_scanned() -> None:
    watch = ShapeWatch(max_containers=65536, max_values=2_097_152)
    assert feed_all(watch, json.dumps({"input": ["a short text"] * 100}).encode()) is None
    assert not watch.suspect
