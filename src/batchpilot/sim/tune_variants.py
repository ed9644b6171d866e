"""The tuner across backends and precisions: one profile per variant, one search per profile.

    batchpilot profile --all-backends -o p.json          # p.torch-float32.json, p.torch-bfloat16.json...
    batchpilot tune --profile-variants p.*.json --sla-p99 1.0 -o best.yaml

A variant is what a profile measured: its backend and precision (``cost_model.meta``: ``backend``,
``dtype``) and its serving path. Each variant's search is the ordinary tuner (``sim.tune.Tuner``) on
that profile's cost model and front end, over the same workload, grid sample and seed; the winner is
the (variant, config) with the most predicted goodput. The config file written carries the winning
config in ``encoder:`` and the variant in ``model:`` (``backend``, ``dtype``), and its header names
the profile to serve it with, so ``serve --profile P --config best.yaml`` runs what was predicted.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.sim.frontend import FrontEnd
from batchpilot.sim.traces import Workload
from batchpilot.sim.tune import TuneConfig, Tuner, TuneResult


@dataclass
class VariantResult:
    profile: str
    backend: str
    dtype: str
    result: TuneResult

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.dtype}"


def tune_variants(workload: Workload, profiles: Sequence[str], tc: TuneConfig, spec: DeploymentSpec,
                  batcher_only: bool = False,
                  log: Callable[[str], None] = lambda _: None) -> list[VariantResult]:
    """One tuner search per profile; ranked by the winner's predicted goodput, best first."""
    out = []
    for path in profiles:
        cost_model = CostModel.load(path)
        meta = cost_model.meta
        frontend = None if batcher_only else FrontEnd.from_profile(path)
        v = VariantResult(path, str(meta.get("backend", "torch")), str(meta.get("dtype", "float32")),
                          Tuner(workload, cost_model, tc, log=log, spec=spec, frontend=frontend).run())
        log(f"{v.label}: best {v.result.best.label}, {v.result.best.rps:.2f} req/s")
        out.append(v)
    return sorted(out, key=lambda v: -v.result.best.rps)


def variants_table(results: Sequence[VariantResult]) -> Any:
    from rich.table import Table

    t = Table(title="the best config of each backend and precision (predicted, P99 within the SLA)")
    for col in ("variant", "best config", "req/s", "vs best", "default req/s", "profile"):
        t.add_column(col, justify="right" if "req/s" in col or col == "vs best" else "left")
    top = results[0].result.best.rps if results else 0.0
    for v in results:
        b = v.result.best
        default = next((c for c in v.result.candidates if c.kind == "default"), None)
        t.add_row(v.label, b.label, f"{b.rps:.2f}", f"{b.rps / top:.2f}" if top else "-",
                  f"{default.rps:.2f}" if default else "-", v.profile)
    return t


def write_variant_yaml(best: VariantResult, path: str | Path, spec: DeploymentSpec) -> Path:
    """The winner as a config file: ``encoder:``, ``server:`` and ``model:`` (its backend and dtype)."""
    from batchpilot.config_file import dump_spec

    b, r = best.result.best, best.result
    header = (f"# batchpilot tune --profile-variants: {r.workload.name} ({len(r.workload)} rows), P99 <= "
              f"{r.sla_p99_s:g} s\n# predicted capacity: rate scale {b.capacity:.3f} = {b.rps:.2f} req/s; "
              f"{best.label}, {b.label}\n# serve it with: batchpilot serve --profile {best.profile} "
              f"--config {path}\n")
    model = replace(spec.model, backend=best.backend, dtype=best.dtype)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return dump_spec(spec.replace(encoder=b.config, model=model), p, header,
                     sections=("encoder", "server", "model"))


def run_variants(args: argparse.Namespace, workload: Workload, tc: TuneConfig, spec: DeploymentSpec,
                  console: Any) -> int:
    from batchpilot.sim.tune_report import result_table

    console.print(f"tuning on {workload.name} across {len(args.profile_variants)} profiles (one search each)")
    results = tune_variants(workload, args.profile_variants, tc, spec, args.batcher_only, console.print)
    console.print(result_table(results[0].result))
    console.print(variants_table(results))
    path = write_variant_yaml(results[0], args.output, spec)
    console.print(f"wrote {path}: {results[0].label}, {results[0].result.best.label}")
    return 0
