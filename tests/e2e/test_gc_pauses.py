"""The server freezes its startup heap out of garbage collection while it serves, and times every
collection into ``batchpilot_gc_pause_seconds`` (an in-process server, real HTTP)."""

from __future__ import annotations

import gc

import httpx
from inproc import live_server

from batchpilot.runtime.executor import NoopExecutor


def test_startup_heap_is_frozen_while_serving_and_pauses_are_measured() -> None:
    assert gc.get_freeze_count() == 0
    with live_server(NoopExecutor(dim=8)) as srv:
        # the objects alive at startup (this test process's whole heap) are out of every collection
        assert gc.get_freeze_count() > 1000
        before = srv.metrics().get("batchpilot_gc_pause_seconds_count{generation=2}", 0.0)
        gc.collect()  # a full collection while serving: one observed pause
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hello", "model": "noop"}, timeout=10)
        assert r.status_code == 200
        m = srv.metrics()
        assert m["batchpilot_gc_pause_seconds_count{generation=2}"] == before + 1
        assert m["batchpilot_gc_pause_seconds_sum{generation=2}"] > 0
    assert gc.get_freeze_count() == 0  # unfrozen at shutdown: nothing leaks into what runs after
    assert not any(type(cb).__name__ == "GCPauses" for cb in gc.callbacks)
