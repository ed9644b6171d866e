"""Writes deploy/grafana/batchpilot.json, the Grafana dashboard over every batchpilot metric.

    python deploy/grafana/build_dashboard.py > deploy/grafana/batchpilot.json

Panels are grouped in rows (serving, batching, admission, latency, executor, LLM, tenants, arms,
process); every query is per ``instance`` (a server, or a Ray replica's scrape target) and ``model``
where the series carries it, filtered by the dashboard's ``$instance`` and ``$model`` variables. The
data source is the ``$datasource`` variable (any Prometheus). ``tests/test_deploy_files.py`` checks
that every metric a query names is one the server exports.
"""

from __future__ import annotations

import json
import sys
from typing import Any

SEL = 'instance=~"$instance",model=~"$model"'
INST = 'instance=~"$instance"'
W = "[$__rate_interval]"


def q(expr: str, legend: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def p99(metric: str, by: str = "instance, model", sel: str = SEL, quantile: str = "0.99") -> str:
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}{W})))"


# (row, [(title, unit, [(expr, legend)]), ...])
ROWS: list[tuple[str, list[tuple[str, str, list[dict[str, Any]]]]]] = [
    ("Queue and autoscaling signals", [
        ("Queue length (inputs waiting)", "short",
         [q(f"batchpilot_queue_length{{{SEL}}}", "{{instance}} {{model}}")]),
        ("Predicted queue wait (backlog per slot)", "s",
         [q(f"batchpilot_backlog_seconds{{{SEL}}}", "{{instance}} {{model}}")]),
        ("Queued tokens", "short", [q(f"batchpilot_queue_tokens{{{SEL}}}", "{{instance}} {{model}}")]),
        ("Requests in progress / inputs pending", "short",
         [q(f"batchpilot_requests_in_progress{{{SEL}}}", "in progress {{instance}} {{model}}"),
          q(f"batchpilot_pending_requests{{{SEL}}}", "pending {{instance}} {{model}}")]),
    ]),
    ("Batching", [
        ("Batch size (mean, P50, P99)", "short",
         [q(f"sum by (instance, model) (rate(batchpilot_batch_size_sum{{{SEL}}}{W})) / "
            f"sum by (instance, model) (rate(batchpilot_batch_size_count{{{SEL}}}{W}))",
            "mean {{instance}} {{model}}"),
          q(p99("batchpilot_batch_size", quantile="0.5"), "P50 {{instance}} {{model}}"),
          q(p99("batchpilot_batch_size"), "P99 {{instance}} {{model}}")]),
        ("Batches per second", "ops",
         [q(f"sum by (instance, model) (rate(batchpilot_batch_size_count{{{SEL}}}{W}))",
            "{{instance}} {{model}}")]),
        ("Padding waste (computed tokens that were padding)", "percentunit",
         [q(f"1 - sum by (instance, model) (rate(batchpilot_useful_tokens_total{{{SEL}}}{W})) / "
            f"sum by (instance, model) (rate(batchpilot_computed_tokens_total{{{SEL}}}{W}))",
            "{{instance}} {{model}}"),
          q(f"1 - batchpilot_padding_efficiency{{{SEL}}}", "since start {{instance}} {{model}}")]),
        ("Tokens per second (useful / computed)", "short",
         [q(f"sum by (instance, model) (rate(batchpilot_useful_tokens_total{{{SEL}}}{W}))",
            "useful {{instance}} {{model}}"),
          q(f"sum by (instance, model) (rate(batchpilot_computed_tokens_total{{{SEL}}}{W}))",
            "computed {{instance}} {{model}}")]),
    ]),
    ("Admission and errors", [
        ("Rejections by reason", "reqps",
         [q(f"sum by (instance, model, reason) (rate(batchpilot_rejections_total{{{SEL}}}{W}))",
            "{{reason}} {{instance}} {{model}}")]),
        ("HTTP requests by route and status", "reqps",
         [q(f"sum by (instance, route, status) (rate(batchpilot_http_requests_total{{{SEL}}}{W}))",
            "{{route}} {{status}} {{instance}}")]),
        ("Refused by the request middleware / in flight", "short",
         [q(f"sum by (instance) (rate(batchpilot_http_refusals_total{{{INST}}}{W}))",
            "refused/s {{instance}}"),
          q(f"batchpilot_http_in_flight{{{INST}}}", "in flight {{instance}}")]),
        ("Cancellations and batch failures", "ops",
         [q(f"sum by (instance, model, stage) (rate(batchpilot_cancellations_total{{{SEL}}}{W}))",
            "cancelled {{stage}} {{instance}} {{model}}"),
          q(f"sum by (instance, model) (rate(batchpilot_batch_failures_total{{{SEL}}}{W}))",
            "batch failures {{instance}} {{model}}")]),
    ]),
    ("Latency", [
        ("Request latency P50 / P99 (arrival to result)", "s",
         [q(p99("batchpilot_request_latency_seconds", quantile="0.5"), "P50 {{instance}} {{model}}"),
          q(p99("batchpilot_request_latency_seconds"), "P99 {{instance}} {{model}}")]),
        ("Queue time P99 (arrival to dispatch)", "s",
         [q(p99("batchpilot_queue_time_seconds"), "P99 {{instance}} {{model}}")]),
        ("HTTP handler time P99 by route", "s",
         [q(p99("batchpilot_http_request_duration_seconds", "instance, route"), "{{route}} {{instance}}")]),
        ("Batch run time P50 / P99", "s",
         [q(p99("batchpilot_batch_run_seconds", quantile="0.5"), "P50 {{instance}} {{model}}"),
          q(p99("batchpilot_batch_run_seconds"), "P99 {{instance}} {{model}}")]),
    ]),
    ("Executor and health", [
        ("Executor utilisation (busy share of slots)", "percentunit",
         [q(f"batchpilot_executor_utilization{{{SEL}}}", "since start {{instance}} {{model}}"),
          q(f"sum by (instance, model) (rate(batchpilot_executor_busy_seconds_total{{{SEL}}}{W}))",
            "busy slot-seconds/s {{instance}} {{model}}")]),
        ("Busy slots, and batches past the watchdog's stall bound since start", "short",
         [q(f"batchpilot_executor_busy_slots{{{SEL}}}", "busy {{instance}} {{model}}"),
          q(f"batchpilot_executor_stalls{{{SEL}}}", "stalled {{instance}} {{model}}"),
          q(f"batchpilot_executor_stalled{{{SEL}}}", "stalled now {{instance}} {{model}}")]),
        ("Encoder fallback (padded float32 path) active, and its batches", "short",
         [q(f"batchpilot_executor_fallback_active{{{SEL}}}", "active {{instance}} {{model}}"),
          q(f"rate(batchpilot_executor_fallback_batches{{{SEL}}}{W})",
            "batches/s {{instance}} {{model}}")]),
        ("Health (1 ok, 0.5 degraded, 0 draining/stopped) and scrape up", "short",
         [q(f"batchpilot_health{{{SEL}}}", "{{instance}} {{model}}"),
          q(f"up{{{INST}}}", "scrape up {{instance}}")]),
        ("Precision served and its minimum cosine to float32", "short",
         [q(f"batchpilot_precision_info{{{SEL}}}", "{{dtype}} {{instance}} {{model}}"),
          q(f"batchpilot_precision_min_cosine{{{SEL}}}", "min cosine {{instance}} {{model}}")]),
    ]),
    ("LLM engine", [
        ("KV cache use", "percentunit",
         [q(f"batchpilot_llm_kv_usage_ratio{{{INST}}}", "used {{instance}}"),
          q(f"batchpilot_llm_kv_fragmentation_ratio{{{INST}}}", "fragmentation {{instance}}")]),
        ("KV blocks used / free", "short",
         [q(f"batchpilot_llm_kv_blocks_used{{{INST}}}", "used {{instance}}"),
          q(f"batchpilot_llm_kv_blocks_free{{{INST}}}", "free {{instance}}")]),
        ("Sequences running / waiting, preemptions", "short",
         [q(f"batchpilot_llm_running_seqs{{{INST}}}", "running {{instance}}"),
          q(f"batchpilot_llm_waiting_seqs{{{INST}}}", "waiting {{instance}}"),
          q(f"rate(batchpilot_llm_preemptions_total{{{INST}}}{W})", "preemptions/s {{instance}}")]),
        ("Memory: planned by part vs used (KV blocks, the process on its device) and free", "bytes",
         [q(f"batchpilot_llm_memory_planned_bytes{{{INST}}}", "planned {{part}} {{instance}}"),
          q(f"batchpilot_llm_memory_used_bytes{{{INST}}}", "used {{part}} {{instance}}"),
          q(f"batchpilot_llm_memory_free_bytes{{{INST}}}", "free {{instance}}")]),
        ("Preemptions by kind, swap space, recompute waste", "short",
         [q(f"rate(batchpilot_llm_swapped_out_total{{{INST}}}{W})", "swapped out/s {{instance}}"),
          q(f"rate(batchpilot_llm_swapped_in_total{{{INST}}}{W})", "swapped in/s {{instance}}"),
          q(f"rate(batchpilot_llm_recompute_preemptions_total{{{INST}}}{W})", "recomputed/s {{instance}}"),
          q(f"rate(batchpilot_llm_recomputed_tokens_total{{{INST}}}{W})", "recomputed tokens/s {{instance}}"),
          q(f"rate(batchpilot_llm_swap_seconds_total{{{INST}}}{W})", "swap s/s {{instance}}"),
          q(f"batchpilot_llm_swapped_seqs{{{INST}}}", "swapped now {{instance}}"),
          q(f"batchpilot_llm_swap_blocks_used{{{INST}}}", "swap blocks used {{instance}}"),
          q(f"batchpilot_llm_swap_blocks_free{{{INST}}}", "swap blocks free {{instance}}")]),
        ("Prefix-cache hit rate (hit tokens / prompt tokens)", "percentunit",
         [q(f"rate(batchpilot_llm_prefix_cache_hit_tokens_total{{{INST}}}{W}) / "
            f"rate(batchpilot_llm_prompt_tokens_total{{{INST}}}{W})", "hit rate {{instance}}")]),
        ("TTFT and inter-token latency P99", "s",
         [q(p99("batchpilot_llm_time_to_first_token_seconds", "instance", INST), "TTFT {{instance}}"),
          q(p99("batchpilot_llm_inter_token_latency_seconds", "instance", INST), "ITL {{instance}}")]),
        ("Tokens per second (generated, prompt, prefix-cache hits)", "short",
         [q(f"batchpilot_llm_generation_tokens_per_second{{{INST}}}", "generated (window) {{instance}}"),
          q(f"rate(batchpilot_llm_generation_tokens_total{{{INST}}}{W})", "generated {{instance}}"),
          q(f"rate(batchpilot_llm_prompt_tokens_total{{{INST}}}{W})", "prompt {{instance}}"),
          q(f"rate(batchpilot_llm_prefix_cache_hit_tokens_total{{{INST}}}{W})", "prefix hits {{instance}}")]),
        ("Engine steps: mean batch and step time", "short",
         [q(f"rate(batchpilot_llm_step_seqs_total{{{INST}}}{W}) / "
            f"rate(batchpilot_llm_steps_total{{{INST}}}{W})", "seqs/step {{instance}}"),
          q(f"rate(batchpilot_llm_step_seconds_total{{{INST}}}{W}) / "
            f"rate(batchpilot_llm_steps_total{{{INST}}}{W})", "s/step {{instance}}"),
          q(f"rate(batchpilot_llm_step_forward_seconds_total{{{INST}}}{W}) / "
            f"rate(batchpilot_llm_steps_total{{{INST}}}{W})", "forward s/step {{instance}}")]),
        ("LLM requests by finish reason, rejected", "reqps",
         [q(f"sum by (instance, route, finish_reason) (rate(batchpilot_llm_requests_total{{{INST}}}{W}))",
            "{{route}} {{finish_reason}} {{instance}}"),
          q(f"sum by (instance, reason) (rate(batchpilot_llm_rejected_requests_total{{{INST}}}{W}))",
            "refused {{reason}} {{instance}}")]),
        ("Engine up / fallback active / faults", "short",
         [q(f"batchpilot_engine_up{{{INST}}}", "up {{instance}}"),
          q(f"batchpilot_engine_fallback_active{{{INST}}}", "fallback {{instance}}"),
          q(f"sum by (instance, kind) (increase(batchpilot_engine_faults_total{{{INST}}}[1h]))",
            "faults/h {{kind}} {{instance}}"),
          q(f"increase(batchpilot_engine_recoveries_total{{{INST}}}[1h])", "recoveries/h {{instance}}"),
          q(f"rate(batchpilot_fallback_requests_total{{{INST}}}{W})", "fallback req/s {{instance}}"),
          q(f"batchpilot_engine_stall_timeout_seconds{{{INST}}}", "stall timeout s {{instance}}")]),
    ]),
    ("Tenants (docs/tenants.md)", [
        ("Requests and tokens admitted per tenant", "reqps",
         [q(f"sum by (instance, model, tenant) (rate(batchpilot_tenant_requests_total{{{SEL}}}{W}))",
            "req/s {{instance}} {{model}} {{tenant}}"),
          q(f"sum by (instance, model, tenant) (rate(batchpilot_tenant_tokens_total{{{SEL}}}{W}))",
            "tokens/s {{instance}} {{model}} {{tenant}}")]),
        ("P99 latency per tenant", "s",
         [q(p99("batchpilot_tenant_request_latency_seconds", "instance, model, tenant"),
            "{{instance}} {{model}} {{tenant}}")]),
        ("Refused or dropped per tenant, by reason", "reqps",
         [q(f"sum by (instance, model, tenant, reason) "
            f"(rate(batchpilot_tenant_rejections_total{{{SEL}}}{W}))",
            "{{instance}} {{model}} {{tenant}} {{reason}}")]),
        ("LLM: requests and tokens admitted per tenant", "reqps",
         [q(f"sum by (instance, tenant) (rate(batchpilot_llm_tenant_requests_total{{{INST}}}{W}))",
            "req/s {{instance}} {{tenant}}"),
          q(f"sum by (instance, tenant) (rate(batchpilot_llm_tenant_tokens_total{{{INST}}}{W}))",
            "tokens/s {{instance}} {{tenant}}")]),
        ("LLM: TTFT P99 per tenant", "s",
         [q(p99("batchpilot_llm_tenant_time_to_first_token_seconds", "instance, tenant", INST),
            "{{instance}} {{tenant}}")]),
        ("LLM: refused per tenant, by reason", "reqps",
         [q(f"sum by (instance, tenant, reason) "
            f"(rate(batchpilot_llm_tenant_rejections_total{{{INST}}}{W}))",
            "{{instance}} {{tenant}} {{reason}}")]),
    ]),
    ("Canary and A/B arms (docs/rollout.md)", [
        ("Share of new requests per arm", "percentunit",
         [q(f"batchpilot_arm_share{{{SEL}}}", "{{instance}} {{model}} {{arm}}")]),
        ("Rolled back (1) and rollbacks by rule", "short",
         [q(f"batchpilot_arm_rolled_back{{{SEL}}}", "rolled back {{instance}} {{model}} {{arm}}"),
          q(f"increase(batchpilot_arm_rollbacks_total{{{SEL}}}{W})", "{{arm}} {{rule}}")]),
        ("P99 latency per arm", "s",
         [q(p99("batchpilot_request_latency_seconds", "instance, model, arm"),
            "{{instance}} {{model}} {{arm}}")]),
    ]),
    ("Process", [
        ("GC pauses P99 and per second", "s",
         [q(p99("batchpilot_gc_pause_seconds", "instance", INST), "P99 {{instance}}"),
          q(f"rate(batchpilot_gc_pause_seconds_count{{{INST}}}{W})", "pauses/s {{instance}}")]),
    ]),
]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row, items in ROWS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(items):
            panels.append({
                "type": "timeseries", "title": title, "id": pid,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi"}},
                "targets": [{**t, "refId": chr(ord("A") + k),
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for k, t in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(items) + 1) // 2)

    def var(name: str, query: str) -> dict[str, Any]:
        return {"name": name, "type": "query", "label": name, "includeAll": True, "multi": True,
                "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "definition": query, "query": {"query": query, "refId": name}}

    return {
        "title": "batchpilot", "uid": "batchpilot", "schemaVersion": 39, "version": 1,
        "tags": ["batchpilot"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "data source",
             "current": {}},
            var("instance", "label_values(batchpilot_health, instance)"),
            var("model", "label_values(batchpilot_health, model)"),
        ]},
        "panels": panels,
    }


def render(board: dict[str, Any]) -> str:
    """JSON with one panel (and one variable) per line: short files, one-line diffs."""
    def line(x: Any) -> str:
        return json.dumps(x, separators=(", ", ": "))

    head = {k: v for k, v in board.items() if k not in ("templating", "panels")}
    out = ["{" + line(head)[1:-1] + ","]
    out.append(' "templating": {"list": [')
    out.append(",\n".join("  " + line(v) for v in board["templating"]["list"]))
    out.append(" ]},")
    out.append(' "panels": [')
    out.append(",\n".join("  " + line(p) for p in board["panels"]))
    out.append(" ]")
    out.append("}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(dashboard()))
