"""Multi-tenant workloads in the simulator (sim/tenants.py): the mix, the per-tenant report, Jain's index
of weighted service under the fair order, ``batchpilot simulate --tenant``, and the load generator's
plan of such a workload (each row sent as its tenant's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchpilot.bench.loadgen import build_plan, with_tenants
from batchpilot.bench.records import RequestRecord, by_tenant, read_csv, write_csv
from batchpilot.cli import main
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.sim.llm import default_llm_cost_model
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.tenants import (
    TenantLoad,
    backlogged_service,
    compare_llm_policies,
    compare_orders,
    jain,
    only,
    per_tenant,
    tenant_mix,
)


def test_parse_a_tenant_spec() -> None:
    t = TenantLoad.parse("search:rate=4.5,weight=2,start=300")
    assert (t.name, t.rate, t.weight, t.workload, t.start) == ("search", 4.5, 2.0, "conv-embed", 300)
    s = TenantLoad.parse("x:rate=10,workload=poisson,lengths=lognormal:median=64/sigma=0.5")
    assert s.lengths == "lognormal:median=64,sigma=0.5"
    for bad in ("x", "x:weight=2", "x:rate=1,colour=red", "x:rate=0"):
        with pytest.raises(ValueError):
            TenantLoad.parse(bad)


def test_the_mix_merges_each_stream_at_its_rate() -> None:
    loads = [TenantLoad("a", 5.0), TenantLoad("b", 20.0, 3.0, "poisson", lengths="constant:value=32")]
    wl, table = tenant_mix(loads, 60.0)
    assert (np.diff(wl.arrival_s) >= 0).all() and wl.arrival_s[0] == 0.0
    assert wl.tenant is not None and set(wl.tenant.tolist()) == {"a", "b"}
    assert abs((wl.tenant == "a").sum() - 300) <= 2 and abs((wl.tenant == "b").sum() - 1200) < 150
    assert (wl.input_tokens[wl.tenant == "b"] == 32).all()
    assert table.spec("b").weight == 3.0 and table.spec("a").weight == 1.0
    assert len(only(wl, "a")) == (wl.tenant == "a").sum()
    assert wl.slice(10, 100).tenant is not None and len(wl.scale_rate(2).tenant) == len(wl)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="differ"):
        tenant_mix([TenantLoad("a", 1.0), TenantLoad("a", 2.0)], 10.0)


def test_weighted_service_is_shared_by_weight_among_backlogged_tenants() -> None:
    """Weights 1:2:4, every tenant sending more than the machine serves: over the time all three have
    work waiting, the tokens each is served divided by its weight are equal under ``fair`` (Jain's index
    >= 0.95), and proportional to the offered load under FIFO."""
    loads = [TenantLoad(name, 60.0, w, "poisson", lengths="lognormal:median=100/sigma=0.6")
             for name, w in (("one", 1.0), ("two", 2.0), ("four", 4.0))]
    wl, table = tenant_mix(loads, 40.0, seed=3)
    cost = CostModel.default_cpu_minilm()
    fair = simulate_encoder(wl, SchedulerConfig.from_dict({"queue_order": "fair"}), cost, tenants=table)
    (lo, hi), served = backlogged_service(fair, table)
    assert hi - lo > 20.0  # all three backlogged for most of the run
    assert jain(list(served.values())) >= 0.95, served
    fifo = simulate_encoder(wl, SchedulerConfig(), cost, tenants=table)
    _, served_fifo = backlogged_service(fifo, table)
    assert jain(list(served_fifo.values())) < 0.9, served_fifo


def test_fair_order_shields_a_light_tenant_from_a_flood() -> None:
    loads = [TenantLoad("light", 4.0), TenantLoad("flood", 100.0, start=4000)]
    wl, table = tenant_mix(loads, 40.0)
    results = compare_orders(wl, table, SchedulerConfig(), CostModel.default_cpu_minilm())
    light = {order: r["light"] for order, r in results.items()}
    assert light["fair"].p99_s * 4 < light["fcfs"].p99_s
    assert light["alone"].p99_s <= light["fair"].p99_s
    assert light["fair"].failed == 0
    total = {order: sum(r.tokens_s for r in results[order].values()) for order in ("fair", "fcfs")}
    assert total["fair"] >= 0.95 * total["fcfs"]  # work-conserving: the flood takes what is left
    assert [r.tenant for r in per_tenant(simulate_encoder(only(wl, "light"), SchedulerConfig()))] == ["light"]


def test_simulate_cli_reports_each_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--tenant", "a:rate=5", "--tenant", "b:rate=5,weight=2,start=2000",
                 "--duration-s", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert "fair P50 / P99 ms" in out and "fcfs P50 / P99 ms" in out and "alone P50 / P99 ms" in out
    assert main(["simulate", "--tenant", "a"]) == 2


def test_simulate_cli_reports_each_llm_tenants_ttft_and_tpot(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--target", "llm", "--tenant", "light:rate=0.5",
                 "--tenant", "flood:rate=10,start=3000", "--duration-s", "20"])
    out = capsys.readouterr().out
    assert code == 0 and "fair TTFT P50 / P99 ms" in out and "fcfs TPOT P99 ms" in out


def test_the_llm_fair_policy_keeps_a_light_tenants_ttft_near_its_own_without_the_flood() -> None:
    """The LLM simulator per tenant (``compare_llm_policies``): beside a flood at several times the
    engine's capacity, a light tenant's TTFT under fair is far below FCFS's, and every one of its
    requests is answered (the sequence bound is shared by weight)."""
    loads = [TenantLoad("light", 0.5, workload="conv-llm"),
             TenantLoad("flood", 12.0, workload="conv-llm", start=3000)]
    wl, table = tenant_mix(loads, 30.0)
    config = LLMSchedulerConfig(max_waiting_seqs=32)  # the flood passes the bound: FCFS refuses light too
    res = compare_llm_policies(wl, table, config, default_llm_cost_model(), without=["flood"])
    light = {k: r["light"] for k, r in res.items()}
    assert light["fair"].failed == 0 and light["fcfs"].failed > 0
    assert light["fair"].ttft_p99_s * 10 < light["fcfs"].ttft_p99_s
    assert light["without"].ttft_p99_s <= light["fair"].ttft_p99_s
    assert "flood" not in res["without"]


def test_a_multi_tenant_plan_sends_each_row_as_its_tenant(tmp_path: Path) -> None:
    wl, _ = tenant_mix([TenantLoad("a", 5.0), TenantLoad("b", 5.0, start=500)], 4.0)
    plan = build_plan(wl, texts=["x"] * len(wl))
    sent = with_tenants(plan, wl, {"b": "b-key-123456"})
    for p in sent:
        assert p.tenant == wl.tenant[p.index]  # type: ignore[index]
        want = {"X-Client-Id": "a"} if p.tenant == "a" else {"Authorization": "Bearer b-key-123456"}
        assert p.headers == want
    records = [RequestRecord(p.index, p.scheduled_s, p.input_tokens, tenant=p.tenant, status=200,
                             sent_s=p.scheduled_s, done_s=p.scheduled_s + 0.1, latency_s=0.1) for p in sent]
    write_csv(records, tmp_path / "r.csv")
    assert [r.tenant for r in read_csv(tmp_path / "r.csv")] == [r.tenant for r in records]
    summaries = by_tenant(records)
    assert set(summaries) == {"a", "b"} and summaries["a"].num_ok == sum(r.tenant == "a" for r in records)
