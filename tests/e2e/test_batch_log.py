"""``serve --batch-log``: one line per batch the server ran, matching its own counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from inproc import FaultyExecutor, live_server

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.runtime.journal import read_batches


def test_batch_log_records_every_batch_with_its_shape_and_slot_time(tmp_path: Path) -> None:
    path = tmp_path / "batches.jsonl"
    ex = FaultyExecutor(delay_s=0.01)
    config = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=4, max_wait_s=0.005))
    with live_server(ex, config, batch_log=str(path)) as srv:
        async def burst() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                rs = await asyncio.gather(*(http.post("/v1/embeddings", json={"input": [7] * (3 + i)})
                                            for i in range(20)))
                assert all(r.status_code == 200 for r in rs)
        asyncio.run(burst())
        m = srv.metrics()
    batches, _ = read_batches(path)
    assert len(batches) == m["batchpilot_batch_size_count"] == len(ex.batches)
    assert sum(b.n for b in batches) == 20
    assert sum(b.features["tokens"] for b in batches) == m["batchpilot_computed_tokens_total"]
    assert all(b.slot_s >= 0.01 for b in batches)  # the executor sleeps 10 ms per batch
    starts = [b.start for b in batches]
    assert starts == sorted(starts)  # one slot: one batch after another
    for a, b in zip(batches, batches[1:], strict=False):
        assert b.start >= a.start + a.slot_s - 1e-6
    assert all(b.formed <= b.start for b in batches)  # formed by the scheduler, then started
    assert all(b.predicted_s > 0 for b in batches)  # and priced by its cost model


def test_a_failing_batch_observer_fails_neither_requests_nor_the_other_observers() -> None:
    seen: list[int] = []

    def broken(batch: object, start: float, slot_s: float) -> None:
        raise OSError("disk full")

    with live_server(FaultyExecutor(), SchedulerConfig()) as srv:
        srv.service.batcher.batch_observers += [broken, lambda b, start, slot_s: seen.append(b.size)]
        for i in range(3):
            r = httpx.post(srv.url + "/v1/embeddings", json={"input": [5] * (4 + i)}, timeout=30)
            assert r.status_code == 200, r.text
    assert seen == [1, 1, 1]  # the observer after the broken one still saw every batch
