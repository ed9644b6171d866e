"""deploy/: the Prometheus alert rules pass ``promtool check rules``, the Grafana dashboard is the one
its builder writes, and every batchpilot metric either names is one the server exports.

What the server exports is read from a real app: ``create_app`` over the no-op model (served in arms,
behind a fallback executor), its /metrics
fetched in-process, plus the LLM engine's collectors (``server/llm/metrics.py``) over a stand-in
engine that reports zeros. A metric family counts with the sample names its type exposes
(``_total`` for counters; ``_bucket``, ``_sum``, ``_count`` for histograms).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "batchpilot.json"
BUILDER = ROOT / "deploy" / "grafana" / "build_dashboard.py"
NAME = re.compile(r"\bbatchpilot_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


class Zeros:
    """A stand-in for the LLM engine (and its failover) whose every reading is 0."""

    observers: list[Any] = []

    def tenant_usage(self) -> list[Any]:  # no tenant has sent a request
        return []

    def __getattr__(self, name: str) -> Any:
        return Zeros()

    def __call__(self, *args: Any) -> Any:
        return Zeros()

    def __getitem__(self, key: Any) -> int:
        return 0

    def __float__(self) -> float:
        return 0.0

    def __int__(self) -> int:
        return 0


def exported_families() -> dict[str, set[str]]:
    """Every metric family the server exports, with the sample names it can expose."""
    pytest.importorskip("fastapi")
    import httpx
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from batchpilot.core.config import SchedulerConfig
    from batchpilot.core.rollout import ArmSpec, RolloutSpec
    from batchpilot.runtime.executor import FallbackExecutor, NoopExecutor
    from batchpilot.runtime.llm.engine import EngineStats
    from batchpilot.server.app import ServedArm, ServedModel, create_app
    from batchpilot.server.config import ServerConfig
    from batchpilot.server.llm.metrics import LLMMetrics

    async def scrape() -> str:  # a model in arms, on an executor with a fallback: every family shows
        executor = FallbackExecutor(NoopExecutor(), NoopExecutor())
        model = ServedModel(executor, SchedulerConfig(), name="noop",
                            rollout=RolloutSpec((ArmSpec("canary", 0.1),)),
                            arms=(ServedArm(executor, SchedulerConfig()),))
        app = create_app(ServerConfig(noop=True), [model])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return (await client.get("/metrics")).text

    engine = Zeros()
    stats = EngineStats(0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0)
    object.__setattr__(engine, "stats", lambda: stats)
    from types import SimpleNamespace

    from batchpilot.core.llm.config import LLMSchedulerConfig, MemoryProfile, plan_kv

    memory = MemoryProfile(weights_bytes=1, kv_bytes_per_token=1, source="measured")
    for name, value in (("main", engine), ("memory_plan", plan_kv(LLMSchedulerConfig(), memory)),
                        ("memory_profile", memory), ("runner", SimpleNamespace(device="cpu"))):
        object.__setattr__(engine, name, value)
    registry = CollectorRegistry()
    LLMMetrics(engine, registry)
    text = asyncio.run(scrape()) + generate_latest(registry).decode()
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names = families.setdefault(family.name, set())
        names.add(family.name)
        names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return families


@pytest.fixture(scope="module")
def families() -> dict[str, set[str]]:
    return exported_families()


@pytest.fixture(scope="module")
def exported(families: dict[str, set[str]]) -> set[str]:
    return set().union(*families.values())


def rule_exprs() -> list[str]:
    yaml = pytest.importorskip("yaml")
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return exprs


def test_promtool_accepts_the_alert_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_rules_cover_p99_rejections_engine_down_kv_and_a_growing_queue() -> None:
    used = {n for e in rule_exprs() for n in NAME.findall(e)}
    assert {"batchpilot_request_latency_seconds_bucket", "batchpilot_rejections_total", "batchpilot_health",
            "batchpilot_engine_up", "batchpilot_llm_kv_usage_ratio", "batchpilot_backlog_seconds"} <= used
    assert any(e.strip().startswith("up{") for e in rule_exprs())


def test_every_metric_the_rules_use_is_exported(exported: set[str]) -> None:
    used = {n for e in rule_exprs() for n in NAME.findall(e)}
    assert used and used <= exported, sorted(used - exported)


def test_every_metric_the_dashboard_uses_is_exported(exported: set[str]) -> None:
    used = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    assert used and used <= exported, sorted(used - exported)


# the step cost-model features are for `bench fidelity`'s reports, not a dashboard
NOT_ON_THE_DASHBOARD = {"batchpilot_llm_step_feature"}


def test_the_dashboard_shows_every_metric_the_server_exports(families: dict[str, set[str]]) -> None:
    used = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    missing = sorted(f for f, names in families.items()
                     if f.startswith("batchpilot_") and not f.endswith("_created")
                     and f not in NOT_ON_THE_DASHBOARD and not names & used)
    assert not missing, f"add a panel to deploy/grafana/build_dashboard.py for {missing}"


def test_the_dashboard_is_what_its_builder_writes() -> None:
    out = subprocess.run([sys.executable, str(BUILDER)], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout == DASHBOARD.read_text(), \
        "stale: python deploy/grafana/build_dashboard.py > deploy/grafana/batchpilot.json"
