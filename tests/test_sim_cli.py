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
    cfg.write_text(yaml.safe_dump(SchedulerConfig(policy=PolicyConfig(name="window")).to_dict()))
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
    cfg.write_text(yaml.safe_dump({"policy": {"name": "window", "max_batch_size": 1, "max_wait_s": 0.0}}))
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
    cfg = SchedulerConfig.from_dict(yaml.safe_load(out.read_text()))
    assert cfg.planner.padding in ("dynamic", "bucket", "max")


def test_simulate_with_the_servers_limits_and_a_front_end(tmp_path: Path) -> None:
    """--server-limits refuses what `serve` would under overload; --frontend adds the serving path."""
    base = ["simulate", "--workload", "conv-embed", "--rate-scale", "8", "--requests", "600"]

    def run(*extra: str) -> dict[str, object]:
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
        assert main([*base, *extra, "--json", str(out)]) == 0
        return dict(json.loads(out.read_text()))

    plain = run()
    limited = run("--server-limits")
    assert plain["num_rejected"] == 0 and int(limited["num_rejected"]) > 0  # type: ignore[call-overload]
    fe = tmp_path / "fidelity.json"
    fe.write_text(json.dumps({"frontend": {"serial_const_s": 0.0, "serial_per_token_s": 0.0,
                                           "delay_const_s": 0.25, "delay_per_token_s": 0.0}}))
    slow = run("--frontend", str(fe))
    lat, lat_fe = plain["latency"], slow["latency"]
    assert lat_fe["p50"] == pytest.approx(lat["p50"] + 0.25)  # type: ignore[index]
    assert slow["queue"] == plain["queue"]  # a pure delay leaves the batcher's queue alone
