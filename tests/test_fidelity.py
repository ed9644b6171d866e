"""``bench fidelity``'s scoring: a prediction against the spread of several live replays, per point and
across a matrix, the points' results, and rescoring an earlier run (with the service model's ablation)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from batchpilot.bench.fidelity import (
    FidelityOptions,
    LivePoint,
    Measurement,
    check_fidelity,
    histogram_mean,
    load_prediction_inputs,
    simulate,
    summary_metrics,
)
from batchpilot.bench.records import RequestRecord, summarize
from batchpilot.bench.scrape import MetricsSeries, parse_metrics
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.sim.service import BatchCost, Noise, RequestCost, ServiceModel
from batchpilot.sim.traces import Workload


def _workload(times: list[float], lengths: list[int] | None = None) -> Workload:
    return Workload.from_columns("t", times, lengths or [8] * len(times))


def test_spread_scores_a_prediction_against_the_replays_median_and_widened_range() -> None:
    from batchpilot.bench.fidelity import score_spread

    # three replays of P99: 100, 130, 90 ms -> median 100, range 90 .. 130, widened 81 .. 143
    c = score_spread("P99 ms", 140.0, [100.0, 130.0, 90.0], 0.5)
    assert (c.median, c.lo, c.hi) == (100.0, 90.0, 130.0)
    assert c.error == pytest.approx(0.40) and c.inside  # 40% off the median, still inside the spread
    assert score_spread("P99 ms", 82.0, [100.0, 130.0, 90.0]).inside
    out = score_spread("P99 ms", 150.0, [100.0, 130.0, 90.0])  # above 130 * 1.1 = 143
    assert not out.inside and out.error == pytest.approx(0.5)
    assert not score_spread("P50 ms", 80.0, [100.0, 130.0, 90.0]).inside  # below 90 * 0.9 = 81
    # rejected counts: within 10% or 5 requests of the median
    assert score_spread("rejected", 5.0, [0.0, 0.0, 40.0]).inside
    assert not score_spread("rejected", 6.0, [0.0, 0.0, 40.0]).inside
    assert score_spread("rejected", 108.0, [100.0, 90.0, 120.0]).inside
    assert not score_spread("rejected", 111.0, [100.0, 90.0, 120.0]).inside
    # NaN replays are left out; none left: never inside
    assert score_spread("P50 ms", 10.0, [math.nan, 10.0]).median == 10.0
    assert not score_spread("P50 ms", 10.0, [math.nan]).inside


def test_matrix_score_gives_the_signed_bias_and_the_latency_cells_inside() -> None:
    from batchpilot.bench.fidelity import (
        format_matrix,
        matrix_score,
        spread_cells,
        spread_rows,
    )

    metrics = ("P50 ms", "P99 ms", "throughput req/s", "rejected")
    replays = [[10.0, 100.0, 20.0, 0.0], [12.0, 120.0, 19.0, 0.0], [11.0, 140.0, 21.0, 2.0]]
    low = spread_cells(0.5, metrics, [9.9, 80.0, 20.0, 0.0], replays)  # P99 20% under the median 100
    high = spread_cells(0.8, metrics, [13.2, 300.0, 20.0, 0.0], [[v * 2 for v in r] for r in replays])
    score = matrix_score(low + high)
    # P50: -10% against 11, +-40% against 22 -> mean -25%; P99: -33.3% and +25% -> mean -4.2%
    assert score["bias"]["P50 ms"] == pytest.approx((-0.1 - 0.4) / 2)
    assert score["bias"]["P99 ms"] == pytest.approx((80 / 120 - 1 + 300 / 240 - 1) / 2)
    assert score["bias"]["P99 ms"] < 0 < matrix_score(high)["bias"]["P99 ms"]  # the sign: + predicts high
    assert math.isnan(score["bias"]["rejected"])  # no finite relative error against a median of 0
    # latency cells: P50 inside at 50% (9.9 >= 9), outside at 80% (13.2 < 18); P99 outside at 50%
    # (80 < 90), inside at 80% (300 <= 308)
    assert [c.inside for c in low + high if c.metric.endswith("ms")] == [True, False, False, True]
    assert (score["latency_inside"], score["latency_cells"], score["latency_inside_share"]) == (2, 4, 0.5)
    rows = spread_rows(low)
    assert rows[1] == ["50%", "P99 ms", "80.00", "120.00", "100.00 .. 140.00", "-33.3%", "no"]
    assert rows[3][2:5] == ["0", "0", "0 .. 2"]
    assert "2 of 4" in format_matrix(score) and "P50 ms -25.0%" in format_matrix(score)


def test_combine_results_scores_several_result_folders_together(tmp_path: Path) -> None:
    from batchpilot.bench.fidelity import combine_results, matrix_score, spread_cells

    a = spread_cells(0.5, ("P99 ms",), [90.0], [[100.0], [110.0]])
    b = spread_cells(0.8, ("P99 ms",), [200.0], [[100.0], [120.0]])
    for name, cells in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "fidelity.json").write_text(
            json.dumps({"points": [{"spread": [c.to_dict() for c in cells]}]}))
    assert combine_results([tmp_path / "a", tmp_path / "b"]) == matrix_score(a + b)
    assert combine_results([tmp_path / "a", tmp_path / "b"])["latency_inside"] == 1



def test_a_point_is_predicted_from_the_profile_and_scored_against_each_replay() -> None:
    """The prediction (medians over the draws) of a point and its entry of fidelity.json: every replay's
    summary and the score of the prediction against their median and range."""
    cm = CostModel.default_cpu_minilm()
    wl = _workload([0.1 * i for i in range(50)], [16 + 8 * (i % 5) for i in range(50)])
    pred = simulate(wl, SchedulerConfig(), cm, sla_s=1.0, service=None)
    assert pred.summary.num_ok == 50 and pred.summary.sla_met
    assert pred.summary.p50 <= pred.summary.p99
    same = Measurement(pred.summary, [], None, {"batch_size": pred.report.mean_batch_size})
    slow = summarize([RequestRecord(i, 0.1 * i, 8, sent_s=0.1 * i, done_s=0.1 * i + pred.summary.p50 * 1.5,
                                    status=200, latency_s=pred.summary.p50 * 1.5) for i in range(50)])
    point = LivePoint(0.5, 1.0, wl, pred, [same, Measurement(slow, [], None, {})]).result()
    assert [c["metric"] for c in point["spread"]] == ["P50 ms", "P99 ms", "throughput req/s", "rejected"]
    p50 = point["spread"][0]
    assert p50["lo"] == pytest.approx(pred.summary.p50 * 1e3) and p50["inside"]
    assert p50["median"] == pytest.approx(pred.summary.p50 * 1e3 * 1.25)  # two replays: their mean
    assert len(point["replays"]) == 2 and summary_metrics(point["replays"][1])[0] == pytest.approx(
        pred.summary.p50 * 1.5e3)
    failed = summarize([RequestRecord(i, 0.1 * i, 8, sent_s=0.1 * i, done_s=0.1 * i, status=503 if i < 8
                                      else 200, latency_s=0.01) for i in range(50)])
    assert summary_metrics(failed.to_dict())[3] == 8


def test_server_histogram_means_from_the_scraped_series() -> None:
    reg = CollectorRegistry()
    h = Histogram("batchpilot_http_request_duration_seconds", "h", ["route"], registry=reg)
    first = parse_metrics(generate_latest(reg).decode())
    h.labels("/v1/embeddings").observe(0.2)
    h.labels("/v1/embeddings").observe(0.4)
    series = MetricsSeries([0.0, 1.0], [first, parse_metrics(generate_latest(reg).decode())])
    name = "batchpilot_http_request_duration_seconds{route=/v1/embeddings}"
    assert histogram_mean(series, name) == pytest.approx(0.3)
    assert math.isnan(series.delta("batchpilot_http_request_duration_seconds_count{route=/v1/embeddings}"))
    counter = MetricsSeries([0.0, 1.0, 2.0], [{"c_total": 5.0}, {"c_total": 7.0}, {"c_total": 12.0}])
    assert counter.delta("c_total") == 7.0 and math.isnan(counter.delta("missing"))


def test_rescore_predicts_an_earlier_runs_points_again_and_ablates_each_term(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--rescore``: the saved replays scored against a prediction made again from the run's profile;
    ``--ablate`` adds one prediction per term of the service model, each scored the same way; a
    workload other than the run's is refused."""
    cm = CostModel.default_cpu_minilm()
    profile = tmp_path / "profile.json"
    cm.save(profile)
    doc = json.loads(profile.read_text())
    doc["service"] = ServiceModel(RequestCost(delay_const_s=0.003, delay_per_token_s=1e-5),
                                  BatchCost(alpha=1.2), Noise(residuals=(-0.1, 0.0, 0.1))).to_dict()
    profile.write_text(json.dumps(doc))
    wl = _workload([0.1 * i for i in range(40)], [16 + 8 * (i % 5) for i in range(40)])
    opts = FidelityOptions(out=tmp_path, spec=DeploymentSpec(), draws=2, rescore=str(tmp_path), ablate=True)
    _, service, dep = load_prediction_inputs(profile, opts)
    assert service is not None and service.without("request delay").request.delay_const_s == 0.0
    pred = simulate(wl, dep.scheduler, cm, 1.0, service, draws=2)
    replay = pred.summary.to_dict()
    (tmp_path / "fidelity.json").write_text(json.dumps({
        "workload": wl.name, "requests": len(wl), "profile": str(profile),
        "points": [{"load": 0.5, "rate_scale": 1.0, "replays": [replay, replay]}]}))
    assert check_fidelity(wl, opts) == 0
    scored = json.loads((tmp_path / "rescore.json").read_text())["variants"]
    assert list(scored) == ["as profiled", *(f"without {t}" for t in ServiceModel.TERMS)]
    first = {c["metric"]: c for c in scored["as profiled"]}
    assert first["P50 ms"]["error"] == pytest.approx(0.0, abs=1e-9)  # the same prediction as the replays
    # without the request delay every request is 3 ms faster or more: the P50 is predicted low
    assert {c["metric"]: c for c in scored["without request delay"]}["P50 ms"]["error"] < 0
    assert "without residuals" in capsys.readouterr().out
    other = _workload([0.1 * i for i in range(30)])
    assert check_fidelity(other, opts) == 2


def test_llm_points_are_scored_against_the_replays_spread_with_the_shared_scoring() -> None:
    """TTFT/TPOT (ms), tokens/s and refusals of each replay go through ``fidelity.spread_cells``."""
    from batchpilot.bench.fidelity import matrix_score, spread_cells
    from batchpilot.bench.llm_fidelity import SPREAD_METRICS, spread_values
    from batchpilot.bench.records import RequestRecord, summarize

    def run(ttft: float, refused: int) -> Any:
        recs = [RequestRecord(i, i * 0.5, 32, 8, sent_s=i * 0.5, done_s=i * 0.5 + 0.2, status=200,
                              latency_s=0.2, ttft_s=ttft, tokens_received=8) for i in range(20)]
        recs += [RequestRecord(20 + i, 10.0, 40, 6, sent_s=10.0, done_s=10.01, status=503, latency_s=0.01)
                 for i in range(refused)]
        return summarize(recs, 2.0)

    replays = [run(0.050, 0), run(0.060, 2), run(0.040, 0)]
    values = [spread_values(r, r.num_requests - r.num_ok) for r in replays]
    assert values[0][0] == pytest.approx(50.0) and values[1][-1] == 2.0
    assert SPREAD_METRICS[-1] == "rejected" and len(values[0]) == len(SPREAD_METRICS)
    predicted = [70.0, *values[0][1:]]  # TTFT P50 70 ms: above 60 * 1.1 = 66
    cells = spread_cells(0.5, SPREAD_METRICS, predicted, values)
    assert cells[0].median == pytest.approx(50.0) and not cells[0].inside and cells[0].error > 0
    assert cells[-1].inside  # 0 refused predicted, median 0
    score = matrix_score(cells)
    assert score["latency_cells"] == 4 and score["bias"]["TTFT P50 ms"] == pytest.approx(0.4)
