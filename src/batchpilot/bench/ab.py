"""``batchpilot bench ab --url URL``: replay a workload against a server whose model is served in arms
(``serve --canary``), and say which arm is better and whether the difference is real at this sample.

Each replayed request carries ``X-Client-Id: client-<k>`` for one of ``--clients`` simulated clients
(drawn with the seed: ``sim.arms.client_keys``, which ``sim.arms.simulate_arms`` assigns by too), so
the server's assignment by client splits them as it would split real users.
The answer's ``X-Batchpilot-Arm`` header says which arm served it. The verdict is ``core.abtest``'s,
on the latencies this client measured (send to last byte, the same window for every arm): ok answers
give the latency sample, 429/503 count as rejections, anything else as errors. The server's own view
(``GET /v1/arms``: batch size, padding efficiency, rollbacks) is printed beside it.

    batchpilot bench ab --url http://127.0.0.1:8000 --workload conv-embed --requests 2000 --rate-scale 2
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from batchpilot.bench.loadgen import PlannedRequest
from batchpilot.bench.records import RequestRecord
from batchpilot.core.abtest import ArmComparison, ArmSample, compare_arms
from batchpilot.core.rollout import PRIMARY
from batchpilot.sim.arms import client_keys
from batchpilot.sim.traces import Workload


@dataclass(frozen=True)
class ABOptions:
    """What ``bench ab`` was asked (``bench/cli.py`` reads it off the flags)."""

    url: str  # the server with arms
    endpoint: str = "embeddings"
    model: str | None = None
    rate_scale: float = 1.0  # what the workload was scaled by (for the table's title)
    clients: int = 64  # simulated clients (X-Client-Id values)
    confidence: float = 0.95
    seed: int = 0
    timeout_s: float = 60.0
    warmup_requests: int = 0
    warmup_s: float = 0.0
    tokenizer: str | None = None
    api_key: str | None = None
    progress: bool = True
    json_path: str | None = None  # also write the verdict here


def with_clients(plan: Sequence[PlannedRequest], clients: int, seed: int = 0) -> list[PlannedRequest]:
    """The plan with each request from one of ``clients`` clients (``sim.arms.client_keys``: the keys
    the simulator assigns arms by)."""
    keys = client_keys(len(plan), clients, seed)
    return [dataclasses.replace(p, headers={**(p.headers or {}), "X-Client-Id": k})
            for p, k in zip(plan, keys, strict=True)]


def samples(records: Sequence[RequestRecord]) -> dict[str, ArmSample]:
    """The measured records split by the arm that answered (unnamed answers under ``""``)."""
    by_arm: dict[str, list[RequestRecord]] = {}
    for r in records:
        if not r.warmup:
            by_arm.setdefault(r.arm, []).append(r)
    out = {}
    for arm, recs in by_arm.items():
        lat = np.array([r.latency_s for r in recs if r.ok and math.isfinite(r.latency_s)])
        rejected = sum(1 for r in recs if r.status in (429, 503))
        out[arm] = ArmSample(arm, lat, len(recs) - len(lat) - rejected, rejected)
    return out


def verdicts(arms: dict[str, ArmSample], confidence: float = 0.95, seed: int = 0) -> list[ArmComparison]:
    if PRIMARY not in arms:
        raise ValueError(f"no answer came from the {PRIMARY!r} arm (arms seen: {sorted(arms) or 'none'}): "
                         "is the model served in arms (serve --canary)?")
    return [compare_arms(arms[PRIMARY], s, confidence, seed=seed) for name, s in sorted(arms.items())
            if name not in (PRIMARY, "")]  # "": answers no arm named (transport errors, timeouts)


def server_view(url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    try:
        return list(httpx.get(url.rstrip("/") + "/v1/arms", headers=headers, timeout=30).json()["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def run_ab(workload: Workload, opts: ABOptions) -> int:
    """Replay ``workload`` (already at its rate) against the server's arms and print the verdicts."""
    from rich.console import Console
    from rich.table import Table

    from batchpilot.bench.loadgen import LoadGenConfig, build_plan, load_tokenizer, replay

    console = Console()
    endpoint: Any = opts.endpoint
    tok = load_tokenizer(opts.tokenizer) if endpoint == "embeddings" else None
    plan = with_clients(build_plan(workload, endpoint, tokenizer=tok, warmup_requests=opts.warmup_requests,
                                   warmup_s=opts.warmup_s, seed=opts.seed), opts.clients, opts.seed)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    if headers:
        plan = [dataclasses.replace(p, headers={**(p.headers or {}), **headers}) for p in plan]
    cfg = LoadGenConfig(url=opts.url, endpoint=endpoint, model=opts.model, timeout_s=opts.timeout_s,
                        progress=opts.progress, scrape_interval_s=0.0)
    result = replay(plan, cfg, description="ab")
    arms = samples(result.records)
    found = verdicts(arms, opts.confidence, opts.seed)
    table = Table(title=f"arms over {len(workload)} requests at rate x{opts.rate_scale} "
                        f"(client-measured latency)")
    for col in ("arm", "answers", "ok", "P50 ms", "P99 ms", "errors", "rejected"):
        table.add_column(col, justify="right")
    for name, s in sorted(arms.items(), key=lambda kv: kv[0] != PRIMARY):
        p50, p99 = ((np.quantile(s.latencies, q) * 1e3 for q in (0.5, 0.99)) if len(s.latencies)
                    else (math.nan, math.nan))
        table.add_row(name or "(none)", str(s.total), str(len(s.latencies)), f"{p50:.1f}", f"{p99:.1f}",
                      str(s.errors), str(s.rejected))
    console.print(table)
    for v in found:
        p99 = v.p99_ratio
        console.print(f"[bold]{v.candidate} vs {v.primary}: {v.verdict}[/bold] — P99 ratio "
                      f"{p99.estimate:.2f} "
                      f"(interval {p99.low:.2f}-{p99.high:.2f}), P50 ratio {v.p50_ratio.estimate:.2f}, "
                      f"n = {v.n_primary} / {v.n_candidate}; " + ("; ".join(v.reasons) or "no rule crossed"))
    view = server_view(opts.url, headers)
    for model in view:
        for arm in model.get("arms", []):
            console.print(f"server {model['model']}/{arm['arm']}: {arm['state']}, share {arm['share']:.2f}, "
                          f"mean batch {arm['mean_batch_size'] or math.nan:.1f}, padding efficiency "
                          f"{arm['padding_efficiency'] or math.nan:.2f}"
                          + (f", rolled back: {arm['rollback']['detail']}" if arm.get("rollback") else ""))
    if opts.json_path:
        doc = {"comparisons": [v.to_dict() for v in found], "server": view}
        Path(opts.json_path).write_text(json.dumps(doc, indent=2))
    return 0
