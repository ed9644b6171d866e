"""The load generator against the real batchpilot server (``batchpilot serve`` subprocess, real MiniLM).

Checks that what the generator sends is what the workload says (the server counts exactly the trace's
token lengths), that records, summary and the server's own counters agree, and that a burst is sent
on schedule rather than after earlier replies (open loop). Where a test needs the server slower than the
load, the model is the no-op one with a fixed delay (its capacity is known on any machine) or held on a
gate; nothing assumes how fast this machine runs MiniLM.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from inproc import FaultyExecutor, LiveServer, live_server, wait_for

from batchpilot.bench.loadgen import LoadGenConfig, build_plan, replay
from batchpilot.bench.records import summarize
from batchpilot.bench.scrape import parse_metrics
from batchpilot.bench.serverproc import serve
from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.traces import Workload, load_workload


@pytest.fixture(scope="module")
def server(server_url: str) -> str:
    """The e2e suite's session server (conftest.py): MiniLM, default config, built-in cost model."""
    return server_url


def test_serverproc_starts_batchpilot_serve(tmp_path: Path) -> None:
    # what `bench --compare cfg.yaml` and the fidelity check use: a no-op model starts in about a second
    profile = tmp_path / "profile.json"
    CostModel.default_cpu_minilm().save(profile)
    with serve(["--noop", "--profile", str(profile), "--log-level", "warning"],
               log_path=tmp_path / "serve.log") as url:
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/v1/models", timeout=2)


def _counters(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def test_replay_of_a_conv_embed_slice_matches_the_server_counters(server: str) -> None:
    wl = load_workload("conv-embed", rate_scale=2.0, start=200, count=30)
    plan = build_plan(wl, warmup_requests=3)
    before = _counters(server)
    res = replay(plan, LoadGenConfig(server, progress=False, scrape_interval_s=0.2))
    after = _counters(server)
    recs = res.records
    assert res.model == "all-MiniLM-L6-v2"
    assert all(r.ok for r in recs), {r.status: r.error for r in recs if not r.ok}
    # the texts tokenise to exactly the trace's lengths: the server counted the same tokens
    useful = after["batchpilot_useful_tokens_total"] - before["batchpilot_useful_tokens_total"]
    assert useful == sum(wl.input_tokens.tolist())
    lat_count = "batchpilot_request_latency_seconds_count"
    assert after[lat_count] - before[lat_count] == len(plan)
    s = summarize(recs, sla_s=1.0)
    assert (s.num_requests, s.num_ok, s.num_warmup) == (27, 27, 3)
    assert s.latency["p50"] <= s.latency["p90"] <= s.latency["p99"] <= s.latency_max_s
    assert s.throughput_rps == pytest.approx(27 / s.duration_s)
    for r in recs:
        assert r.scheduled_s - 1e-3 <= r.sent_s <= r.done_s
        assert r.latency_s == pytest.approx(r.done_s - r.sent_s)
    # the client measured at least what the server measured for the same requests (HTTP on top)
    lat_sum = "batchpilot_request_latency_seconds_sum"
    server_mean = (after[lat_sum] - before[lat_sum]) / len(plan)
    client_mean = sum(r.latency_s for r in recs) / len(recs)
    assert client_mean >= server_mean
    assert res.metrics is not None and "batchpilot_queue_length" in res.metrics.queue_names()
    assert res.metrics.find("batch", "size") == "batchpilot_batch_size"
    assert math.isfinite(res.metrics.histogram_mean("batchpilot_batch_size"))


def one_at_a_time() -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0,
                                               wait_only_if_it_pays=False))


@pytest.fixture
def held() -> Iterator[tuple[LiveServer, FaultyExecutor]]:
    """The no-op model held on a gate: nothing is answered until the test opens it."""
    ex = FaultyExecutor()
    ex.gate.clear()
    with live_server(ex, one_at_a_time()) as srv:
        try:
            yield srv, ex
        finally:
            ex.gate.set()


def test_a_burst_is_sent_on_schedule_not_after_replies(held: tuple[LiveServer, FaultyExecutor]) -> None:
    # 10 requests of 512 tokens due within 18 ms, against a model that answers nothing until all ten
    # have reached the server. An open-loop client has sent them all before the first reply; a
    # closed-loop one would wait for the first reply before sending the second, and never finish.
    srv, ex = held
    n = 10
    wl = Workload.from_columns("burst", [0.002 * i for i in range(n)], [512] * n)
    plan = build_plan(wl, seed=1)
    out: dict[str, Any] = {}
    sender = threading.Thread(target=lambda: out.update(res=replay(
        plan, LoadGenConfig(srv.url, progress=False, scrape_interval_s=0))), daemon=True)
    sender.start()
    wait_for(lambda: srv.service.batcher.num_pending == n, timeout_s=60, what="all ten at the server")
    ex.gate.set()
    sender.join(60)
    recs = out["res"].records
    assert len(recs) == n and all(r.ok for r in recs), [r.error for r in recs if not r.ok]
    assert max(r.sent_s for r in recs) < min(r.done_s for r in recs)
    assert summarize(recs).errors == {}


def test_capacity_probe_fails_on_an_overload() -> None:
    """An overload relative to a capacity known on any machine: the no-op model takes a fixed 50 ms per
    batch of one (at most 20 req/s), and conv-embed at 16x its rate offers about 90 req/s."""
    from batchpilot.bench.capacity import CapacityConfig, live_capacity

    wl = load_workload("conv-embed", start=200, count=40)
    assert len(wl) / float(wl.arrival_s[-1] - wl.arrival_s[0]) * 16 > 2 * 20  # over twice the capacity
    cfg = CapacityConfig(sla_s=0.5, start=16.0, hi=16.0, lo=16.0, max_probes=1, probe_s=5.0, cooldown_s=5.0)
    with live_server(FaultyExecutor(delay_s=0.05), one_at_a_time()) as srv:
        res = live_capacity(wl, LoadGenConfig(srv.url, progress=False, scrape_interval_s=0), cfg)
    (probe,) = res.probes
    assert not probe.passed and res.rate_scale == 0.0


def test_server_timing_splits_each_request(server: str) -> None:
    import asyncio

    from batchpilot.bench.loadgen import build_plan, load_tokenizer, one_by_one_async
    from batchpilot.models.texts import texts_for_lengths

    wl = load_workload("conv-embed", rate_scale=1.0, start=0, count=8)
    texts = texts_for_lengths(load_tokenizer(), wl.input_tokens.tolist())
    plan = build_plan(wl, texts=texts)
    recs = asyncio.run(one_by_one_async(plan, LoadGenConfig(server, progress=False, scrape_interval_s=0)))
    assert len(recs) == 8 and all(r.ok for r in recs)
    for r in recs:  # the server's parts nest inside the client's latency
        assert r.server_tokenize_s > 0 and r.server_batcher_s > 0
        assert r.server_tokenize_s + r.server_batcher_s <= r.server_app_s + 2e-6  # rounded to the us
        assert r.server_app_s <= r.latency_s


def test_fidelity_predicts_from_the_profile_alone_and_scores_each_point_against_its_replays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench fidelity`` end to end on the no-op model (a fixed 20 ms per batch, the profile exactly
    that): one prediction per load point, made before the server starts, two live replays of it, the
    prediction scored against their median and range, and the deployment flags handed to the server
    unchanged; ``--rescore`` then scores the same replays again without a server."""
    from batchpilot import cli

    out = tmp_path / "fid"
    config = tmp_path / "bs1.yaml"
    config.write_text("encoder:\n  policy: {max_batch_size: 1}\n")  # capacity 50 req/s: one batch at a time
    flags = ["--noop-delay-ms", "20", "--config", str(config), "--requests", "120", "--loads", "0.5",
             "--max-concurrency", "64"]
    rc = cli.main(["bench", "fidelity", *flags, "--warmup-requests", "2", "--live-repeats", "2",
                   "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "fidelity.json").read_text())
    (point,) = res["points"]
    assert point["load"] == 0.5 and [r["num_requests"] for r in point["replays"]] == [120, 120]
    assert point["servers"][0]["batch_size"] == pytest.approx(1.0)  # max_batch_size 1, from the server
    # the prediction against both replays' median and range, and the run's bias and latency cells inside
    assert [c["metric"] for c in point["spread"]] == ["P50 ms", "P99 ms", "throughput req/s", "rejected"]
    p99 = point["spread"][1]
    assert p99["lo"] <= p99["median"] <= p99["hi"]
    assert p99["predicted"] == pytest.approx(point["predicted"]["latency"]["p99"] * 1e3)
    assert res["matrix"]["latency_cells"] == 2 and set(res["matrix"]["bias"]) >= {"P50 ms", "P99 ms"}
    assert len(res["spread_table"]["rows"]) == 4
    assert "concurrency <= 64" in res["deployment"]
    text = capsys.readouterr().out
    assert text.index("predicted at 50%") < text.index("50% live #1") < text.index("50% live #2")
    assert "bias (mean signed error against the replays' median)" in text
    assert cli.main(["bench", "fidelity", *flags, "--rescore", str(out)]) == 0
    again = json.loads((out / "rescore.json").read_text())["variants"]["as profiled"]
    assert again == point["spread"]  # the same profile, the same prediction, the same replays
