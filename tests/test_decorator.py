"""``@batch`` on real asyncio: single-item calls are batched into list calls, sync and async, methods."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchpilot.core.admission import RejectReason
from batchpilot.core.config import SchedulerConfig
from batchpilot.runtime import RequestRejected, batch
from batchpilot.runtime.errors import ExecutionError


def test_async_function_is_called_with_lists_and_callers_get_their_own_result() -> None:
    calls: list[list[str]] = []

    @batch(policy="hybrid", max_batch_size=8, max_wait_s=0.005, length=len)
    async def shout(items: list[str]) -> list[str]:
        calls.append(list(items))
        return [s.upper() for s in items]

    async def main() -> list[str]:
        out = await asyncio.gather(*(shout(f"w{i}") for i in range(20)))
        await shout.shutdown()
        return list(out)

    assert asyncio.run(main()) == [f"W{i}" for i in range(20)]
    assert sum(len(c) for c in calls) == 20 and max(len(c) for c in calls) <= 8
    assert len(calls) < 20  # they were batched
    assert shout.__name__ == "shout"


def test_sync_function_runs_in_a_worker_thread() -> None:
    threads: set[str] = set()

    @batch(max_batch_size=4, max_wait_s=0.0)
    def square(xs: list[int]) -> list[int]:
        threads.add(threading.current_thread().name)
        return [x * x for x in xs]

    async def main() -> list[int]:
        return list(await asyncio.gather(*(square(i) for i in range(10))))

    assert asyncio.run(main()) == [i * i for i in range(10)]
    assert threads and threading.main_thread().name not in threads
    # a second event loop gets its own Batcher (the first one's loop is gone)
    assert asyncio.run(main()) == [i * i for i in range(10)]


def test_methods_batch_per_instance() -> None:
    class Model:
        def __init__(self, k: int) -> None:
            self.k = k
            self.sizes: list[int] = []

        @batch(max_batch_size=16, max_wait_s=0.005)
        async def scale(self, xs: list[int]) -> list[int]:
            self.sizes.append(len(xs))
            return [self.k * x for x in xs]

    a, b = Model(2), Model(10)

    async def main() -> tuple[list[int], list[int]]:
        ra = asyncio.gather(*(a.scale(i) for i in range(5)))
        rb = asyncio.gather(*(b.scale(i) for i in range(5)))
        return list(await ra), list(await rb)

    assert asyncio.run(main()) == ([0, 2, 4, 6, 8], [0, 10, 20, 30, 40])
    assert sum(a.sizes) == 5 and sum(b.sizes) == 5


def test_a_failing_item_fails_alone() -> None:
    @batch(max_batch_size=8, max_wait_s=0.005)
    def inverse(xs: list[float]) -> list[float]:
        return [1.0 / x for x in xs]

    async def main() -> list[object]:
        return list(await asyncio.gather(*(inverse(x) for x in [1.0, 0.0, 4.0]), return_exceptions=True))

    out = asyncio.run(main())
    assert out[0] == 1.0 and out[2] == 0.25 and isinstance(out[1], ExecutionError)


def test_a_tuned_config_and_its_limits_apply() -> None:
    cfg = SchedulerConfig.from_dict({"policy": {"name": "window", "max_batch_size": 2, "max_wait_s": 0.0},
                                     "admission": {"max_length": 3}})

    @batch(config=cfg, length=len)
    async def echo(items: list[str]) -> list[str]:
        assert len(items) <= 2
        return items

    async def main() -> None:
        assert await asyncio.gather(*(echo("ab") for _ in range(5))) == ["ab"] * 5
        with pytest.raises(RequestRejected) as err:
            await echo("abcd")
        assert err.value.reason is RejectReason.TOO_LONG

    asyncio.run(main())
