"""``runtime.journal.JsonLines``: the caller only queues; a writer thread writes whole lines."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from batchpilot.runtime.journal import JsonLines, wait_written


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_append_queues_and_flush_writes_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    log = JsonLines(path, lambda i: {"i": i}, flush_s=60.0)  # the writer thread will not run meanwhile
    for i in range(5):
        log.append(i)
    assert path.read_text() == ""  # nothing written on the appending thread
    assert log.flush() == 5
    assert [d["i"] for d in _lines(path)] == [0, 1, 2, 3, 4]
    log.append(5)
    log.close()
    log.append(6)  # after close: dropped, no error
    log.close()  # idempotent
    assert [d["i"] for d in _lines(path)] == list(range(6))


def test_the_writer_thread_writes_without_a_flush(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    log = JsonLines(path, lambda i: {"i": i}, flush_s=0.05)
    try:
        log.append(1)
        wait_written(0.05)  # three periods: enough on an idle machine; a loaded one may take longer
        deadline = time.monotonic() + 30.0
        while not path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [d["i"] for d in _lines(path)] == [1]  # written by the writer thread: nobody flushed
    finally:
        log.close()


def test_an_item_that_cannot_be_written_loses_only_itself(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"

    def to_json(i: int) -> dict:
        if i == 1:
            raise ValueError("bad item")
        return {"i": i}

    log = JsonLines(path, to_json, flush_s=60.0)
    for i in range(3):
        log.append(i)
    log.close()
    assert [d["i"] for d in _lines(path)] == [0, 2]


def test_many_threads_append_and_every_line_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    log = JsonLines(path, lambda i: {"i": i, "pad": "x" * (i % 50)}, flush_s=0.001)

    def worker(base: int) -> None:
        for i in range(500):
            log.append(base + i)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    got = sorted(d["i"] for d in _lines(path))
    assert got == sorted(k * 1000 + i for k in range(4) for i in range(500))


def test_a_flush_period_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flush period"):
        JsonLines(tmp_path / "e.jsonl", dict, flush_s=0.0)
