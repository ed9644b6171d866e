"""The encoder's failover on a real server: a primary path that fails falls back to the plain path with
nobody failed, /metrics shows it; a batch that hangs turns /health 503 until it ends."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
from inproc import FaultyExecutor, live_server, scrape, wait_for

from batchpilot.runtime.executor import FallbackExecutor, NoopExecutor


class BrokenFastPath(NoopExecutor):
    """A primary path that fails every batch (a padding-free kernel that broke)."""

    def run(self, prepared: list[Any]) -> list[Any]:
        raise RuntimeError("ragged kernel failed")


async def embed_one_by_one(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        return [(await c.post("/v1/embeddings", json={"input": f"text {i}"})).status_code for i in range(n)]


async def embed_all(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        rs = await asyncio.gather(*(c.post("/v1/embeddings", json={"input": f"text number {i}"})
                                    for i in range(n)))
        return [r.status_code for r in rs]


def test_a_failing_primary_path_falls_back_and_nobody_sees_it() -> None:
    executor = FallbackExecutor(BrokenFastPath(), NoopExecutor())
    with live_server(executor) as srv:
        # one at a time: each its own batch, so the breaker's 3 failures come whatever the machine's speed
        assert asyncio.run(embed_one_by_one(srv.url, 4)) == [200] * 4
        assert asyncio.run(embed_all(srv.url, 30)) == [200] * 30
        m = scrape(srv.url)
        assert m["batchpilot_executor_fallback_active"] == 1.0
        assert m["batchpilot_executor_fallback_batches"] >= 1
        assert m["batchpilot_batch_failures_total"] == 0.0
        assert httpx.get(srv.url + "/health").status_code == 200


def test_a_hung_batch_turns_health_503_until_it_ends() -> None:
    executor = FaultyExecutor()
    with live_server(executor, encoder_stall_timeout_s=0.3) as srv:
        executor.gate.clear()  # the next batch hangs in the model
        answers: list[int] = []
        client = threading.Thread(target=lambda: answers.extend(asyncio.run(embed_all(srv.url, 1))))
        client.start()
        executor.running.wait(10)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, what="health 503")
        assert httpx.get(srv.url + "/health").json()["status"] == "degraded"
        assert scrape(srv.url)["batchpilot_executor_stalls"] == 1.0
        executor.gate.set()
        client.join(10)
        assert answers == [200]  # the stuck batch's request is answered when it ends
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, what="health back to 200")


def test_the_served_minilm_has_its_padded_float32_path_standing_by(server_url: str) -> None:
    m = scrape(server_url)  # lean forward by default: the plain padded path is its fallback
    assert m["batchpilot_executor_fallback_active"] == 0.0
    assert m["batchpilot_executor_stalls"] == 0.0
