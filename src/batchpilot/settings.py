"""The one config file and the one set of deployment flags, shared by serve, simulate, tune and bench.

    encoder:            # core.config.SchedulerConfig (what `batchpilot tune` writes)
      policy: {name: hybrid, max_batch_size: 16, max_wait_s: 0.005}
      planner: {padding: none}
    llm:                # core.llm.scheduler.LLMSchedulerConfig (serve --llm, simulate --target llm)
      max_num_seqs: 64
    server:             # core.deployment.ServingOptions
      max_concurrency: 512
      request_timeout_s: 60
      latency_sla_s: 1.0   # declare an SLA: refuse what would miss it (default: none, no shedding)
    model:              # core.deployment.ModelOptions (serve and profile: the encoder's precision)
      dtype: auto          # auto | float32 | bfloat16 | float16 | int8
      min_cosine: 0.999    # the accuracy guard against float32
      backend: torch       # torch | onnx (ONNX Runtime, padded batches)
    arms:               # core.rollout.RolloutSpec (serve): candidates beside this deployment
      assign: client       # client (stable hash of X-Client-Id, else the connection) | random
      candidates:
        - {name: canary, share: 0.1, config: b.yaml}   # the sections of a file (relative to this one)
        - {name: wide, share: 0.1, encoder: {policy: {max_batch_size: 64}}}  # or given here, each in
                                                       # place of this deployment's (flags applied)
      rollback: {max_p99_ratio: 1.5, max_p50_ratio: 2.0, window_s: 60}  # core.rollout.RollbackRules

Every section is optional. ``add_deployment_args`` adds the flags that override the file, with the
same names and meanings in every command, and ``spec_from_args`` reads them back, so ``simulate`` and
``serve`` given the same flags run the same deployment (``core.deployment.resolve_deployment``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from batchpilot.core.config import PADDINGS, POLICIES, _build
from batchpilot.core.deployment import BACKENDS, PRECISIONS, DeploymentSpec
from batchpilot.core.llm.config import PREEMPTION_MODES
from batchpilot.core.rollout import ASSIGNMENTS, ArmSpec, RollbackRules, RolloutSpec


def _read(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with encoder/llm/server sections, "
                         f"got {type(data).__name__}")
    return dict(data or {})


def load_spec(path: str | Path | None) -> DeploymentSpec:
    """The file's ``DeploymentSpec`` (the defaults for None); errors name the file and the key. Its
    ``arms:`` section is ``load_rollout``'s."""
    if path is None:
        return DeploymentSpec()
    data = _read(path)
    data.pop("arms", None)
    try:
        return DeploymentSpec.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


_ARM_KEYS = {"name", "share", "config"}


def candidate_spec(primary: DeploymentSpec, sections: dict[str, Any], where: str) -> DeploymentSpec:
    """``primary`` (flags applied) with the sections a candidate gives in place of the primary's."""
    if "arms" in sections:
        raise ValueError(f"{where} has arms of its own")
    return DeploymentSpec.from_dict({**primary.to_dict(), **sections})


def load_rollout(path: str | Path | None, primary: DeploymentSpec | None = None) -> RolloutSpec:
    """The file's ``arms:`` section (none: one arm). A candidate's deployment is ``primary`` (the
    file's own deployment, flags applied) with the sections the candidate gives in place of the
    primary's: inline, or the sections of its ``config:`` file."""
    if path is None:
        return RolloutSpec()
    section = _read(path).get("arms")
    if section is None:
        return RolloutSpec()
    try:
        if not isinstance(section, dict):
            raise ValueError("arms: expected a mapping with candidates (and assign, rollback)")
        unknown = sorted(set(section) - {"assign", "candidates", "rollback"})
        if unknown:
            raise ValueError(f"arms: unknown key(s) {unknown}; the keys are assign, candidates, rollback")
        base = primary or load_spec(path)
        arms = []
        for item in section.get("candidates") or []:
            if not isinstance(item, dict) or "name" not in item or "share" not in item:
                raise ValueError(f"arms.candidates: each needs a name and a share, got {item!r}")
            sections = {k: v for k, v in item.items() if k not in _ARM_KEYS}
            if "config" in item:
                if sections:
                    raise ValueError(f"arm {item['name']}: give a config file or sections, not both")
                sub = Path(path).parent / str(item["config"])
                spec = candidate_spec(base, _read(sub), f"arm {item['name']}: {sub}")
            else:
                spec = candidate_spec(base, sections, f"arm {item['name']}")
            arms.append(ArmSpec(str(item["name"]), item["share"], spec))
        rules = _build(RollbackRules, "arms.rollback", dict(section.get("rollback") or {}))
        return RolloutSpec(tuple(arms), str(section.get("assign", "client")), rules)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def dump_spec(spec: DeploymentSpec, path: str | Path, header: str = "",
              sections: tuple[str, ...] = ("encoder", "server")) -> Path:
    """Write the sections of ``spec`` that a command produced (the tuner: encoder and server)."""
    data = {k: v for k, v in spec.to_dict().items() if k in sections}
    p = Path(path)
    p.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return p


def flag(help: str, **argparse_kw: Any) -> dict[str, Any]:
    """A dataclass field's metadata for ``add_field_flags``: its flag's help, and any ``add_argument``
    keyword where the field's own does not do (``type``, ``choices``, ``metavar``, ``dest``)."""
    return {"flag": {"help": help, **argparse_kw}}


def add_field_flags(group: Any, cls: type, names: tuple[str, ...] | None = None) -> None:
    """One flag per field of the dataclass ``cls`` that carries ``flag`` metadata (in ``names``' order
    when given): ``--field-name``, dest the field's name, type and default the field's default's, help
    the metadata's. A section whose flags map one to one to its fields states each default and help
    once, on the field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names or tuple(n for n, f in fields.items() if "flag" in f.metadata):
        f = fields[name]
        kw = dict(f.metadata["flag"])
        kw.setdefault("type", type(f.default))
        kw.setdefault("dest", name)
        group.add_argument("--" + name.replace("_", "-"), default=f.default, **kw)


def add_deployment_args(p: argparse.ArgumentParser, *, config_help: str | None = None) -> None:
    """``--config`` and the flags that override it (the same in serve, simulate, tune and bench)."""
    g = p.add_argument_group("deployment (the same flags in serve, simulate, tune and bench fidelity)")
    g.add_argument("--config", default=None,
                   help=config_help or "config YAML with encoder:, llm: and server: sections")
    g.add_argument("--policy", choices=POLICIES, default=None, help="override encoder.policy.name")
    g.add_argument("--max-batch-size", type=int, default=None, help="override encoder.policy.max_batch_size")
    g.add_argument("--max-wait-ms", type=float, default=None, help="override encoder.policy.max_wait_s")
    g.add_argument("--padding", choices=PADDINGS, default=None, help="override encoder.planner.padding")
    g.add_argument("--num-slots", type=int, default=None, help="override encoder.num_slots")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in progress at once before 503 (server.max_concurrency, default 512; "
                        "0 = no limit); given, it also bounds the LLM engine's admitted sequences unless "
                        "llm.max_waiting_seqs is set (core/llm/config.py)")
    g.add_argument("--request-timeout-s", type=float, default=None,
                   help="answer 504 when a request is not done by then (server.request_timeout_s, "
                        "default 60); given, it also applies to the LLM routes unless "
                        "llm.request_timeout_s is set (their own default: 600)")
    g.add_argument("--tokenizer-workers", type=int, default=None,
                   help="threads tokenising inputs and prompts off the event loop, per model "
                        "(server.tokenizer_workers; default: one per core the server may run on); the "
                        "simulator's serial stage has as many servers")
    g.add_argument("--latency-sla", type=float, default=None, metavar="S",
                   help="declare a latency SLA in seconds: refuse (503) a request whose predicted "
                        "completion would miss it (server.latency_sla_s; default none: no shedding)")


def spec_from_args(args: argparse.Namespace) -> DeploymentSpec:
    """The config file with the command-line overrides applied on top."""
    spec = load_spec(getattr(args, "config", None))
    enc = spec.encoder
    pol: dict[str, Any] = {}
    if getattr(args, "policy", None) is not None:
        pol["name"] = args.policy
    if getattr(args, "max_batch_size", None) is not None:
        pol["max_batch_size"] = args.max_batch_size
    if getattr(args, "max_wait_ms", None) is not None:
        pol["max_wait_s"] = args.max_wait_ms / 1000.0
    if pol:
        enc = dataclasses.replace(enc, policy=dataclasses.replace(enc.policy, **pol))
    if getattr(args, "padding", None) is not None:
        enc = dataclasses.replace(enc, planner=dataclasses.replace(enc.planner, padding=args.padding))
    if getattr(args, "num_slots", None) is not None:
        enc = dataclasses.replace(enc, num_slots=args.num_slots)
    model = spec.model
    given = {k: getattr(args, k, None) for k in ("dtype", "min_cosine", "backend")}
    if any(v is not None for v in given.values()):
        model = dataclasses.replace(model, **{k: v for k, v in given.items() if v is not None})
    spec = llm_from_args(spec, args)
    return spec.replace(encoder=enc, model=model, max_concurrency=getattr(args, "max_concurrency", None),
                        request_timeout_s=getattr(args, "request_timeout_s", None),
                        latency_sla_s=getattr(args, "latency_sla", None),
                        tokenizer_workers=getattr(args, "tokenizer_workers", None))


_FLAGS = (("config", "--config"), ("policy", "--policy"), ("max_batch_size", "--max-batch-size"),
          ("max_wait_ms", "--max-wait-ms"), ("padding", "--padding"), ("num_slots", "--num-slots"),
          ("max_concurrency", "--max-concurrency"), ("request_timeout_s", "--request-timeout-s"),
          ("latency_sla", "--latency-sla"), ("tokenizer_workers", "--tokenizer-workers"))


# LLM engine flags: the llm: section's field names, as vLLM spells its flags
def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--min-cosine`` and ``--backend`` (serve): override the file's ``model:`` section."""
    g = p.add_argument_group("precision (models/precision.py)")
    g.add_argument("--dtype", choices=PRECISIONS, default=None,
                   help="encoder precision (default auto: the fastest this machine supports that passes "
                        "the accuracy guard; a --profile's measured choice when given one)")
    g.add_argument("--min-cosine", type=float, default=None,
                   help="accuracy guard: least cosine to float32 embeddings on the probe set (default 0.999)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="encoder backend: torch (default) or onnx (ONNX Runtime, padded batches)")


def deployment_flags(args: argparse.Namespace) -> list[str]:
    """The deployment flags given on this command line, to hand on unchanged to ``batchpilot serve``."""
    out: list[str] = []
    for attr, flag in _FLAGS:
        value = getattr(args, attr, None)
        if value is not None:
            out += [flag, str(Path(value).resolve()) if attr == "config" else str(value)]
    return out


def add_rollout_args(p: argparse.ArgumentParser) -> None:
    """``--canary`` and the rollout flags (serve): a second arm beside the deployment, over ``arms:``."""
    g = p.add_argument_group("canary and A/B arms (docs/rollout.md)")
    g.add_argument("--canary", default=None, metavar="CONFIG",
                   help="serve this config file as a candidate arm beside --config's deployment")
    g.add_argument("--canary-share", type=float, default=None,
                   help="--canary: its share of the traffic (default 0.1)")
    g.add_argument("--arm-assign", choices=ASSIGNMENTS, default=None,
                   help="client: a stable hash of X-Client-Id, else the connection (default); random")
    g.add_argument("--rollback-p99-ratio", type=float, default=None,
                   help=f"roll a candidate back when its P99 exceeds this times the primary's "
                        f"(default {RollbackRules.max_p99_ratio})")
    g.add_argument("--rollback-window-s", type=float, default=None,
                   help=f"the rules' sliding window (default {RollbackRules.window_s:.0f} s)")
    g.add_argument("--rollback-min-samples", type=int, default=None,
                   help=f"answers per arm in the window before a rate or P99 rule applies "
                        f"(default {RollbackRules.min_samples})")
    g.add_argument("--no-rollback", action="store_true", help="compare the arms but never roll one back")


def rollout_from_args(args: argparse.Namespace, primary: DeploymentSpec) -> RolloutSpec:
    """The config file's ``arms:`` with ``--canary`` added and the rollout flags applied."""
    rollout = load_rollout(getattr(args, "config", None), primary)
    arms = rollout.arms
    if getattr(args, "canary", None):
        spec = candidate_spec(primary, _read(args.canary), f"--canary {args.canary}")
        arms = (*arms, ArmSpec("canary", 0.1 if args.canary_share is None else args.canary_share, spec))
    elif getattr(args, "canary_share", None) is not None:
        raise SystemExit("--canary-share needs --canary CONFIG")
    rules = rollout.rules
    flags = {"max_p99_ratio": "rollback_p99_ratio", "window_s": "rollback_window_s",
             "min_samples": "rollback_min_samples"}
    changed: dict[str, Any] = {k: getattr(args, a) for k, a in flags.items()
                               if getattr(args, a, None) is not None}
    if getattr(args, "no_rollback", False):
        changed["enabled"] = False
    if changed:
        rules = dataclasses.replace(rules, **changed)
    return RolloutSpec(arms, getattr(args, "arm_assign", None) or rollout.assign, rules)


# The LLM engine's settings as command-line flags, the same for ``serve --llm`` and ``simulate --target
# llm``: each overrides the config file's ``llm:`` section (``core/llm/config.py``; docs/llm.md).

LLM_FLAGS: dict[str, type] = {"max_num_seqs": int, "max_num_batched_tokens": int, "max_model_len": int,
                              "block_size": int, "num_kv_blocks": int, "max_waiting_seqs": int,
                              "max_priority_wait_s": float, "decode_run_tokens": int}


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """The LLM engine's settings as flags (serve --llm, simulate --target llm): override ``llm:``."""
    from batchpilot.core.llm.config import LLMSchedulerConfig

    g = p.add_argument_group("LLM engine (override the config file's llm: section; docs/llm.md)")
    d = LLMSchedulerConfig()
    for name, kind in LLM_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"llm.{name} (default {getattr(d, name)})")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=f"llm.enable_chunked_prefill (default {d.enable_chunked_prefill})")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"llm.enable_prefix_caching (default {d.enable_prefix_caching})")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help=f"llm.policy (default {d.policy})")
    g.add_argument("--llm-request-timeout-s", type=float, default=None, dest="llm_request_timeout_s",
                   help=f"llm.request_timeout_s: a completion not done by then ends with 504 (or an SSE "
                        f"error event) and its sequence is freed (default: --request-timeout-s when "
                        f"given, else {d.request_timeout_s:g})")
    m = p.add_argument_group("LLM memory (docs/llm.md, \"Memory planning\")")
    m.add_argument("--kv-cache-memory", type=_size(""), default=None, metavar="SIZE",
                   help="llm.kv_cache_memory: bytes of KV cache (4GiB, 512MiB, 2e9); sizes the pool")
    m.add_argument("--memory-utilization", "--gpu-memory-utilization", type=float, default=None,
                   dest="memory_utilization", metavar="SHARE",
                   help="llm.memory_utilization: the share in (0, 1] of the device's free memory at start-up "
                        "the engine may use; the KV pool is what weights and the activation peak leave")
    m.add_argument("--swap-space", type=_size("gib"), default=None, metavar="SIZE",
                   help="llm.swap_space: host memory for swapped-out KV blocks (a bare number is GiB, "
                        "here and in the file; default: none, no swap)")
    m.add_argument("--preemption", choices=PREEMPTION_MODES, default=None,
                   help=f"llm.preemption: recompute, swap, or auto (swap when copying is cheaper than "
                        f"recomputing; default {d.preemption})")


def _size(default_unit: str) -> Callable[[str], int]:
    from batchpilot.core.config import parse_bytes

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, default_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def llm_from_args(spec: DeploymentSpec, args: argparse.Namespace) -> DeploymentSpec:
    """``spec`` with the LLM flags given on this command line applied to its ``llm:`` section (the
    section's own validation names what to change)."""
    names = (*LLM_FLAGS, "enable_chunked_prefill", "enable_prefix_caching", "kv_cache_memory",
             "memory_utilization", "swap_space", "preemption")
    given = {k: getattr(args, k, None) for k in names}
    if getattr(args, "scheduling_policy", None) is not None:
        given["policy"] = args.scheduling_policy
    if getattr(args, "llm_request_timeout_s", None) is not None:
        given["request_timeout_s"] = args.llm_request_timeout_s
    changed = {k: v for k, v in given.items() if v is not None}
    # a flag that sizes the pool replaces the file's way of sizing it
    if {"kv_cache_memory", "memory_utilization", "num_kv_blocks"} & set(changed):
        changed.setdefault("kv_cache_memory", None)
        changed.setdefault("memory_utilization", None)
    return (spec.replace(llm=dataclasses.replace(spec.llm, **changed), llm_given=frozenset(changed))
            if changed else spec)


