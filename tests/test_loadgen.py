"""The load generator: open-loop timing, records and summary, streams, early stop, capacity search,
/metrics parsing, the report and the CLI — against a tiny real FastAPI server on a free port.

The fake server runs in a uvicorn thread of this process. Its ``/v1/embeddings`` serves one request at
a time (a lock) for ``delay_s`` seconds, so a closed-loop client would be forced to send request i+1
only after reply i; the open-loop test checks that the server saw every request arrive before it sent
its first reply.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from batchpilot.bench.capacity import CapacityConfig, probe_rows, probe_workload, search_capacity, sla_lost
from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest, build_plan, replay
from batchpilot.bench.records import RequestRecord, read_csv, summarize, write_csv
from batchpilot.bench.report import RunData, write_report
from batchpilot.bench.scrape import MetricsSeries, parse_metrics
from batchpilot.bench.serverproc import free_port
from batchpilot.sim.traces import Workload


class FakeServer:
    """State shared with the app: per-request server-side arrival and reply times."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.arrived: list[float] = []
        self.replied: list[float] = []
        self.ports: list[int] = []  # the client port of each request: one per connection
        self.lock: asyncio.Lock | None = None
        self.waiting = 0
        self.registry = CollectorRegistry()
        self.queue = Gauge("fake_queue_length", "waiting", registry=self.registry)
        self.batch = Histogram("fake_batch_size", "batch size", registry=self.registry, buckets=(1, 2, 4, 8))

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, object]:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/embeddings")
        async def embeddings(req: Request) -> JSONResponse:
            body = await req.json()
            self.arrived.append(time.monotonic())
            self.ports.append(req.client.port if req.client else -1)
            if "FAIL" in body["input"]:
                return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, 503)
            if self.lock is None:
                self.lock = asyncio.Lock()
            self.waiting += 1
            self.queue.set(self.waiting)
            async with self.lock:
                self.waiting -= 1
                self.queue.set(self.waiting)
                await asyncio.sleep(self.delay_s)
                self.batch.observe(2)
                self.replied.append(time.monotonic())
            return JSONResponse({"object": "list", "model": body["model"],
                                 "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.5]}]})

        @app.post("/v1/completions")
        async def completions(req: Request) -> StreamingResponse:
            body = await req.json()

            async def gen() -> object:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(0.005)
                    # the first token's text is held back (half a UTF-8 character): still a token
                    chunk = {"choices": [{"index": 0, "text": " a" if i else ""}]}
                    yield "data: " + json.dumps(chunk) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")  # type: ignore[arg-type]

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(generate_latest(self.registry).decode())

        return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, FakeServer]]:
    state = FakeServer()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(state.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(10)


def _workload(times: list[float], lengths: list[int] | None = None,
              outputs: list[int] | None = None) -> Workload:
    return Workload.from_columns("t", times, lengths or [8] * len(times), outputs)


def _texts(n: int, fail: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
    return ["FAIL" if i in fail else f"text number {i}" for i in range(n)]


def test_replay_is_open_loop_against_a_serial_slow_endpoint(fake: tuple[str, FakeServer]) -> None:
    url, state = fake
    state.delay_s, state.arrived, state.replied = 0.4, [], []
    n = 8
    wl = _workload([0.03 * i for i in range(n)])
    res = replay(build_plan(wl, texts=_texts(n)), LoadGenConfig(url, progress=False, scrape_interval_s=0))
    state.delay_s = 0.0
    assert all(r.ok for r in res.records), [r.error for r in res.records]
    # every request reached the server before its first reply went out (closed loop: 1 before 1 reply)
    assert len(state.arrived) == n and max(state.arrived) < min(state.replied)
    sent = [r.sent_s for r in res.records]
    assert max(sent) < min(r.done_s for r in res.records)
    assert sent == sorted(sent)
    # served one at a time: the k-th reply comes after k service times, so latency grows with the index
    lat = [r.latency_s for r in sorted(res.records, key=lambda r: r.done_s)]
    assert lat == sorted(lat) and lat[-1] > (n - 1) * 0.4 - 0.03 * n


def test_records_and_summary_are_consistent(fake: tuple[str, FakeServer], tmp_path: Path) -> None:
    url, state = fake
    state.delay_s = 0.002
    n = 40
    wl = _workload([0.01 * i for i in range(n)], [4 + i for i in range(n)])
    plan = build_plan(wl, texts=_texts(n, fail={7, 21}), warmup_requests=5)
    res = replay(plan, LoadGenConfig(url, progress=True, scrape_interval_s=0.05))
    recs = res.records
    assert res.model == "fake-model" and not res.stopped_early
    assert [r.index for r in recs] == list(range(n))
    assert [r.scheduled_s for r in recs] == pytest.approx(wl.arrival_s.tolist())
    assert [r.input_tokens for r in recs] == wl.input_tokens.tolist()
    assert sum(r.warmup for r in recs) == 5
    for r in recs:
        assert r.sent_s >= r.scheduled_s - 1e-3 and r.done_s >= r.sent_s
        if r.ok:
            assert r.latency_s == pytest.approx(r.done_s - r.sent_s)
    assert {r.index: r.status for r in recs if not r.ok} == {7: 503, 21: 503}
    s = summarize(recs, sla_s=1.0)
    assert (s.num_requests, s.num_ok, s.num_warmup) == (35, 33, 5)
    assert s.errors == {"503": 2} and not s.sla_met  # a failed request counts against the SLA
    ok_lat = [r.latency_s for r in recs if r.ok and not r.warmup]
    assert s.latency["p50"] == pytest.approx(float(np.percentile(ok_lat, 50)))
    assert s.latency["p99"] == pytest.approx(float(np.percentile(ok_lat, 99)))
    assert s.throughput_rps == pytest.approx(33 / s.duration_s)
    assert s.goodput_rps <= s.throughput_rps
    assert s.offered_rps == pytest.approx(34 / (0.01 * 34), rel=1e-6)
    assert math.isfinite(s.send_lag["p99"]) and s.send_lag["p50"] >= -1e-3
    # the CSV holds everything the summary needs
    write_csv(recs, tmp_path / "r.csv")
    again = read_csv(tmp_path / "r.csv")
    s2 = summarize(again, sla_s=1.0)
    assert s2.num_ok == s.num_ok and s2.errors == s.errors
    assert s2.latency["p99"] == pytest.approx(s.latency["p99"], abs=2e-6)
    # the scraper saw the server's gauge and histogram
    assert res.metrics is not None and res.metrics.queue_names() == ["fake_queue_length"]
    assert res.metrics.histogram_mean("fake_batch_size") == pytest.approx(2.0)


def test_streamed_completions_give_ttft_and_inter_token_gaps(fake: tuple[str, FakeServer]) -> None:
    url, _ = fake
    wl = _workload([0.0, 0.02, 0.04], [5, 6, 7], [3, 1, 6])
    plan = build_plan(wl, "completions")
    assert [len(p.body["prompt"]) for p in plan] == [5, 6, 7]  # token-id prompts of the exact length
    assert all(p.body["ignore_eos"] and p.body["stream"] for p in plan)
    assert [p.body["max_tokens"] for p in plan] == [3, 1, 6]
    res = replay(plan, LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0))
    for r, want in zip(res.records, [3, 1, 6], strict=True):
        assert r.ok and r.tokens_received == want and len(r.itl_s) == want - 1
        assert 0 < r.ttft_s <= r.latency_s
    s = summarize(res.records)
    assert s.ttft and s.itl and s.tpot and s.output_tokens_per_s > 0


def test_stop_when_stops_sending_and_records_the_rest(fake: tuple[str, FakeServer]) -> None:
    url, state = fake
    state.delay_s = 0.3
    n = 30
    wl = _workload([0.02 * i for i in range(n)])
    stop = sla_lost(0.1, n)  # every reply is late: stop once one is
    res = replay(build_plan(wl, texts=_texts(n)), LoadGenConfig(url, progress=False, scrape_interval_s=0),
                 stop_when=stop)
    state.delay_s = 0.0
    assert res.stopped_early
    assert len(res.records) == n
    unsent = [r for r in res.records if not math.isfinite(r.sent_s)]
    assert unsent and all(r.error.startswith("not sent") for r in unsent)
    assert not summarize(res.records, 0.1).sla_met


@settings(max_examples=30, deadline=None)
@given(threshold=st.floats(0.06, 60.0), start=st.floats(0.1, 8.0))
def test_capacity_search_brackets_a_monotone_threshold(threshold: float, start: float) -> None:
    def probe(k: float) -> object:
        rec = RequestRecord(0, 0.0, 8, sent_s=0.0, done_s=k / threshold, status=200, latency_s=k / threshold)
        late = RequestRecord(1, 1.0 / k, 8, sent_s=1.0 / k, done_s=1.0 / k + k / threshold, status=200,
                             latency_s=k / threshold)
        return summarize([rec, late], sla_s=1.0)  # P99 = k / threshold: passes exactly up to threshold

    cfg = CapacityConfig(start=start, lo=0.05, hi=64.0, rel_tol=0.05, max_probes=30)
    res = search_capacity(probe, cfg)  # type: ignore[arg-type]
    assert 0 < res.rate_scale <= threshold
    assert threshold / res.rate_scale <= 1.05 + 1e-9
    if threshold < 64.0:  # a failing probe above the answer was seen (at hi=64 everything passes)
        assert res.bracketed


def test_probe_workload_is_bounded_in_time() -> None:
    wl = _workload([float(i) for i in range(100)])
    assert len(probe_workload(wl, 2.0, 10.0)) == 21  # arrivals at 0, 0.5, .., 10.0
    assert probe_workload(wl, 2.0, 10.0).arrival_s[-1] <= 10.0
    # the busiest window: a burst of 30 rows in one second at t=50 is what a short probe must contain
    times = sorted([float(i) for i in range(100)] + [50.0 + i / 30 for i in range(30)])
    start, count = probe_rows(_workload(times), 1.0, 2.0, busiest=True)
    assert times[start] >= 49.0 and count >= 30
    burst = probe_workload(_workload(times), 1.0, 2.0, busiest=True)
    assert burst.arrival_s[0] == 0.0 and burst.arrival_s[-1] <= 2.0 and len(burst) == count


def test_parse_metrics_andhistogram_mean() -> None:
    reg = CollectorRegistry()
    g = Gauge("bp_queue_waiting_requests", "q", ["model", "kind"], registry=reg)
    h = Histogram("bp_batch_size", "b", registry=reg, buckets=(1, 8, 32))
    g.labels("m", "a").set(3)
    g.labels("n", "a").set(2)
    first = parse_metrics(generate_latest(reg).decode())
    for v in (4, 8, 12):
        h.observe(v)
    last = parse_metrics(generate_latest(reg).decode())
    assert first["bp_queue_waiting_requests{kind=a}"] == 5.0  # the whole server: summed over models
    per_model = parse_metrics(generate_latest(reg).decode(), by_model=True)
    assert per_model["bp_queue_waiting_requests{kind=a,model=m}"] == 3.0
    assert per_model["bp_queue_waiting_requests{kind=a,model=n}"] == 2.0
    series = MetricsSeries([0.0, 1.0], [first, last])
    assert series.queue_names() == ["bp_queue_waiting_requests{kind=a}"]
    assert series.find("batch", "size") == "bp_batch_size"
    assert series.histogram_mean("bp_batch_size") == pytest.approx(8.0)


def test_report_embeds_the_plots(tmp_path: Path) -> None:
    recs = [RequestRecord(i, 0.1 * i, 8, sent_s=0.1 * i, done_s=0.1 * i + 0.05 + 0.001 * i, status=200,
                          latency_s=0.05 + 0.001 * i) for i in range(60)]
    queue = MetricsSeries([0.0, 1.0], [{"q_waiting": 0.0}, {"q_waiting": 2.0}])
    run = RunData("a", recs, summarize(recs), queue)
    path = write_report(tmp_path, [run], sla_s=1.0)
    page = path.read_text()
    assert page.count("data:image/png;base64,") == 3
    for name in ("latency_cdf.png", "latency_vs_rate.png", "over_time.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_cli_run_writes_records_summary_and_report(fake: tuple[str, FakeServer], tmp_path: Path) -> None:
    from batchpilot.cli import main

    url, state = fake
    state.delay_s = 0.001
    trace = tmp_path / "t.csv"
    _workload([0.05 * i for i in range(12)], [6 + i for i in range(12)]).to_csv(trace)
    rc = main(["bench", "--url", url, "--workload", str(trace), "--rate-scale", "1", "2", "--warmup", "2",
               "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary) == 2 and all(v["num_ok"] == 10 and v["num_warmup"] == 2 for v in summary.values())
    recs = read_csv(next(out.glob("records-*x2.csv")))
    assert len(recs) == 12 and all(r.ok for r in recs)
    assert (out / "report.html").exists()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        LoadGenConfig("http://x", "chat")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="http"):
        LoadGenConfig("127.0.0.1:8000")
    assert LoadGenConfig("http://h:1/v1/").base_url == "http://h:1"
    with pytest.raises(ValueError, match="lo <= start <= hi"):
        CapacityConfig(start=100.0)
    assert PlannedRequest(0, 0.0, 1, 0, {}).warmup is False


def test_bench_padding_forwards_every_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from batchpilot.cli import build_parser

    seen: list[list[str]] = []
    fake_mod = types.ModuleType("batchpilot.bench.padding")
    fake_mod.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "batchpilot.bench.padding", fake_mod)
    args = build_parser().parse_args(["bench", "padding", "--requests", "4", "--help"])
    assert args.func(args) == 0 and seen == [["--requests", "4", "--help"]]


def test_llm_fidelity_simulation_reports_ttft_as_the_latency() -> None:
    from batchpilot.bench.llm_fidelity import simulate
    from batchpilot.core.llm.config import LLMSchedulerConfig
    from batchpilot.sim.llm import default_llm_cost_model

    wl = _workload([0.5 * i for i in range(12)], [16 + 4 * i for i in range(12)], [4 + i for i in range(12)])
    s, rep = simulate(wl, LLMSchedulerConfig(), default_llm_cost_model(), sla_s=1.0)
    assert s.num_ok == rep.num_finished == 12 and not s.errors
    assert s.latency["p50"] == s.ttft["p50"] == rep.ttft_p50 and s.ttft["p99"] == rep.ttft_p99
    assert s.sla_met == (rep.ttft_p99 <= 1.0) and s.output_tokens_per_s == rep.output_tokens_per_s


def test_server_timing_header_is_parsed_leniently(tmp_path: Path) -> None:
    from batchpilot.bench.loadgen import parse_server_timing

    header = 'tokenize;dur=0.5, batcher;desc="queue+model";dur=12, cache;desc=hit, x;dur=oops'
    got = parse_server_timing(header)
    assert got == pytest.approx({"tokenize": 0.0005, "batcher": 0.012})
    assert parse_server_timing("") == {}
    # the split travels through the CSV; CSVs written before it existed still read
    rec = RequestRecord(0, 0.0, 8, sent_s=0.0, done_s=0.02, status=200, latency_s=0.02,
                        server_tokenize_s=0.001, server_batcher_s=0.015, server_app_s=0.017)
    write_csv([rec], tmp_path / "r.csv")
    assert read_csv(tmp_path / "r.csv")[0].server_batcher_s == pytest.approx(0.015)
    old = tmp_path / "old.csv"
    lines = (tmp_path / "r.csv").read_text().splitlines()
    header = lines[0].split(",")
    keep = [i for i, h in enumerate(header) if not h.startswith("server_")]
    old.write_text("\n".join(",".join(line.split(",")[i] for i in keep) for line in lines) + "\n")
    assert math.isnan(read_csv(old)[0].server_batcher_s)


def test_model_discovery_picks_the_card_that_fits_the_endpoint() -> None:
    """`serve --llm` lists the embedding model (with dimensions) first and the LLM after it."""
    import asyncio

    import httpx

    from batchpilot.bench.loadgen import discover_model

    def app(cards: list[dict[str, object]]) -> httpx.MockTransport:
        return httpx.MockTransport(lambda req: httpx.Response(200, json={"object": "list", "data": cards}))

    both = [{"id": "emb", "dimensions": 384}, {"id": "llm"}]

    async def pick(cards: list[dict[str, object]], endpoint: str) -> str:
        async with httpx.AsyncClient(transport=app(cards), base_url="http://x") as c:
            return await discover_model(c, endpoint)  # type: ignore[arg-type]

    assert asyncio.run(pick(both, "completions")) == "llm"
    assert asyncio.run(pick(both, "embeddings")) == "emb"
    assert asyncio.run(pick([{"id": "other"}], "embeddings")) == "other"  # no dimensions field anywhere
    assert asyncio.run(pick([], "completions")) == "default"


def test_a_load_generator_keeps_its_connections_under_the_servers_keep_alive() -> None:
    from batchpilot.bench.serverproc import KEEPALIVE_MARGIN_S, client_keepalive_s
    from batchpilot.server.config import ServerConfig

    assert client_keepalive_s() == ServerConfig.keep_alive_s - KEEPALIVE_MARGIN_S
    assert client_keepalive_s(["--profile", "p.json", "--keep-alive-s", "60"]) == 60 - KEEPALIVE_MARGIN_S
    assert client_keepalive_s(["--keep-alive-s=3"]) == 1.5  # a short keep-alive: half of it
    assert client_keepalive_s(["--keep-alive-s", "60"], given=7.0) == 7.0  # bench --keepalive-s wins
    assert client_keepalive_s(given=0.0) == 0.0  # passed on as given: LoadGenConfig refuses it below
    assert LoadGenConfig("http://h:1", keepalive_s=25.0).keepalive_s == 25.0
    with pytest.raises(ValueError, match="keepalive_s"):
        LoadGenConfig("http://h:1", keepalive_s=0.0)


def test_replay_keeps_an_idle_connection_for_keepalive_s_and_no_longer(fake: tuple[str, FakeServer]) -> None:
    url, state = fake
    wl = _workload([0.0, 0.8])  # one connection suffices; idle 0.8 s between the two requests
    for keep, connections in ((0.3, 2), (10.0, 1)):
        state.ports = []
        res = replay(build_plan(wl, texts=_texts(2)),
                     LoadGenConfig(url, progress=False, scrape_interval_s=0, keepalive_s=keep))
        assert all(r.ok for r in res.records)
        assert len(set(state.ports)) == connections, (keep, state.ports)


