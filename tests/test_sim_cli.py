"""``batchpilot simulate`` and ``batchpilot tune`` end to end through the real CLI entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main
from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel


def test_simulate_prints_the_table_and_writes_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"encoder": SchedulerConfig(policy=PolicyConfig(name="window")).to_dict()}))
    rc = main(["simulate", "--workload", "conv-embed", "--rate-scale", "4", "--requests", "400",
               "--config", str(cfg), "--plot", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "default_cpu_minilm" in out  # says which cost model it used without --profile
    assert "latency p99" in out and "padding efficiency" in out and "goodput" in out
    for name in ("latency_cdf.png", "queue_length.png", "batch_size.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000


def test_simulate_uses_the_profile_and_synthetic_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slow = CostModel(latency_coef=(0.5, 0.0, 0.0, 0.0), memory_coef=(0.0, 0.0, 0.0, 0.0))
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"cost_model": slow.to_dict(), "points": []}))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"encoder": {"policy": {"name": "window", "max_batch_size": 1,
                                                          "max_wait_s": 0.0}}}))
    rc = main(["simulate", "--workload", "poisson:rate=0.01", "--requests", "50", "--lengths",
               "constant:value=8", "--profile", str(prof), "--config", str(cfg),
               "--priorities", "0:0.5,-1:0.5", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "default_cpu_minilm" not in out
    assert json.loads((tmp_path / "r.json").read_text())["num_completed"] == 50
    assert re.search(r"latency p50\s*│\s*500\.0 ms", out)  # the profile's 0.5 s per call


def test_simulate_reports_bad_input_as_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "no-such-thing"]) == 2
    assert "unknown workload" in capsys.readouterr().out


def test_tune_writes_a_config_serve_can_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "best.yaml"
    rc = main(["tune", "--workload", "conv-embed", "--sla-p99", "1.0", "--requests", "500",
               "--candidates", "3", "--paddings", "dynamic,bucket", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "static bs8, pad to max" in text and "winner" in text
    from batchpilot.settings import load_spec

    cfg = load_spec(out).encoder
    assert cfg.planner.padding in ("dynamic", "bucket", "max")


def test_simulate_runs_the_servers_deployment_and_the_profiles_serving_path(tmp_path: Path) -> None:
    """The flags mean what they mean for `serve`: no shedding unless a latency SLA is declared; the
    concurrency limit refuses; the profile's serving path delays every request."""
    base = ["simulate", "--workload", "conv-embed", "--rate-scale", "8", "--requests", "600"]

    def run(*extra: str) -> dict[str, object]:
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
        assert main([*base, *extra, "--json", str(out)]) == 0
        return dict(json.loads(out.read_text()))

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"cost_model": CostModel.default_cpu_minilm().to_dict(), "points": []}))
    plain = run("--profile", str(prof))
    assert plain["num_rejected"] == 0  # overloaded, but nothing declared: it queues
    shed = run("--profile", str(prof), "--latency-sla", "1.0")
    assert int(shed["num_rejected"]) > 0  # type: ignore[call-overload]
    capped = run("--profile", str(prof), "--max-concurrency", "4")
    assert int(capped["num_rejected"]) > 0  # type: ignore[call-overload]
    with_fe = tmp_path / "profile_fe.json"
    with_fe.write_text(json.dumps({"cost_model": CostModel.default_cpu_minilm().to_dict(), "points": [],
                                   "service": {"request": {"delay_const_s": 0.25}}}))
    slow = run("--profile", str(with_fe))
    lat, lat_fe = plain["latency"], slow["latency"]
    assert lat_fe["p50"] == pytest.approx(lat["p50"] + 0.25)  # type: ignore[index]
    assert slow["queue"] == plain["queue"]  # a pure delay leaves the batcher's queue alone
    alone = run("--profile", str(with_fe), "--batcher-only")
    assert alone["latency"] == plain["latency"]


def test_one_config_file_for_encoder_llm_and_server(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "llm.yaml"
    cfg.write_text(yaml.safe_dump({"llm": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
                                   "server": {"max_concurrency": 64}}))
    assert main(["simulate", "--workload", "conv-llm", "--target", "llm", "--requests", "20",
                 "--config", str(cfg)]) == 0
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"policy": {"name": "window"}}))
    assert main(["simulate", "--requests", "10", "--config", str(flat)]) == 2
    assert "go under 'encoder:'" in " ".join(capsys.readouterr().out.split())


def test_simulate_with_a_canary_reports_each_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "wait.yaml").write_text("encoder:\n  policy: {name: window, max_batch_size: 32, "
                                        "max_wait_s: 0.2, wait_only_if_it_pays: false}\n")
    rc = main(["simulate", "--workload", "conv-embed", "--rate-scale", "4", "--requests", "600",
               "--canary", str(tmp_path / "wait.yaml"), "--canary-share", "0.5", "--clients", "50"])
    out = capsys.readouterr().out
    assert rc == 0 and "over 2 arms" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert set(rows) >= {"primary", "canary"} and "1.00x" in rows["primary"]
