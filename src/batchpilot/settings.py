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

Every section is optional. ``add_deployment_args`` (with ``add_precision_args`` and ``add_llm_args``)
adds the flags that override the file, with the same names and meanings in every command, and
``spec_from_args`` reads them back, so ``simulate`` and ``serve`` given the same flags run the same
deployment (``core.deployment.resolve_deployment``). Each flag is made from its section's dataclass
field (``add_field_flags``: the field's ``flag`` metadata gives its help and, where they differ from the
field's, its name, type and unit), so a key and its flag are defaulted, typed and described once.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig, _build, parse_bytes
from batchpilot.core.deployment import DeploymentSpec, ModelOptions, ServingOptions
from batchpilot.core.llm.config import LLMSchedulerConfig
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


# A field's "flag" metadata is a plain dict (core's dataclasses carry it without importing argparse):
#   help             the help; an override flag's is formatted with {key} (the section key, e.g.
#                    llm.max_num_seqs) and {default} (the field's default)
#   name, aliases    the flag and its other spellings, where it is not --field-name
#   type, choices, metavar   as add_argument's (type: the default's type unless given)
#   unit             how the flag reads a bare number where the field differs: "ms" (the field holds
#                    seconds), "bytes" or "gib" (a size with an optional unit: 4GiB, 512MiB, 2e9)
_SIZE_UNITS = {"bytes": "", "gib": "gib"}


def _options(name: str, meta: dict[str, Any]) -> tuple[str, ...]:
    return (meta.get("name", "--" + name.replace("_", "-")), *meta.get("aliases", ()))


def _dest(name: str, meta: dict[str, Any]) -> str:
    """Where argparse puts a field's flag: its first spelling's name (``--latency-sla``: latency_sla)."""
    return _options(name, meta)[0].lstrip("-").replace("-", "_")


def add_field_flags(group: Any, cls: type, names: tuple[str, ...] | None = None, *,
                    section: str | None = None, help: str = "{key}") -> None:
    """One flag per field of the dataclass ``cls`` that carries ``flag`` metadata (in ``names``' order
    when given): ``--field-name`` unless the metadata names it, type the field's default's unless the
    metadata says, a bool field ``--x/--no-x``. Without ``section`` the flag sets the field (dest the
    field's name, default the field's). With one it overrides the config file's ``section:`` key:
    default None ("not given, the file's value stands"), help the metadata's (else ``help``) with
    ``{key}`` and ``{default}`` filled in; ``fields_from_args`` reads the given ones back. A section
    whose flags map one to one to its fields states each default and help once, on the field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names or tuple(n for n, f in fields.items() if "flag" in f.metadata):
        f = fields[name]
        kw = dict(f.metadata["flag"])
        options = _options(name, kw)
        kw.pop("name", None)
        kw.pop("aliases", None)
        unit = kw.pop("unit", None)
        if unit == "ms":
            kw.setdefault("type", float)
        elif unit is not None:
            kw.setdefault("type", _size(_SIZE_UNITS[unit]))
        if isinstance(f.default, bool) and "type" not in kw:
            kw.setdefault("action", argparse.BooleanOptionalAction)
        else:
            kw.setdefault("type", type(f.default))
        if section is None:
            kw.setdefault("dest", name)
            group.add_argument(*options, default=f.default, **kw)
        else:
            kw["help"] = kw.get("help", help).format(key=f"{section}.{name}", default=f.default)
            group.add_argument(*options, default=None, **kw)


def fields_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` whose override flags (``add_field_flags`` with a section) were given, in
    the field's unit; a namespace without a flag counts it as not given."""
    given: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("flag")
        if meta is None:
            continue
        value = getattr(args, _dest(f.name, meta), None)
        if value is not None:
            given[f.name] = value / 1000.0 if meta.get("unit") == "ms" else value
    return given


# The deployment flags, in --help order: the encoder: fields they override, then the server: ones
_ENCODER_FLAGS: tuple[tuple[str, type, tuple[str, ...]], ...] = (
    ("encoder.policy", PolicyConfig, ("name", "max_batch_size", "max_wait_s")),
    ("encoder.planner", PlannerConfig, ("padding",)),
    ("encoder", SchedulerConfig, ("num_slots", "queue_order")))
_SERVER_FLAGS = ("max_concurrency", "request_timeout_s", "tokenizer_workers", "latency_sla_s")


def add_deployment_args(p: argparse.ArgumentParser, *, config_help: str | None = None) -> None:
    """``--config`` and the flags that override it (the same in serve, simulate, tune and bench)."""
    g = p.add_argument_group("deployment (the same flags in serve, simulate, tune and bench fidelity)")
    g.add_argument("--config", default=None,
                   help=config_help or "config YAML with encoder:, llm: and server: sections")
    for section, cls, names in _ENCODER_FLAGS:
        add_field_flags(g, cls, names, section=section, help="override {key}")
    add_field_flags(g, ServingOptions, _SERVER_FLAGS, section="server")


def spec_from_args(args: argparse.Namespace) -> DeploymentSpec:
    """The config file with the command-line overrides applied on top."""
    spec = load_spec(getattr(args, "config", None))
    enc = spec.encoder
    pol = fields_from_args(args, PolicyConfig)
    if pol:
        enc = dataclasses.replace(enc, policy=dataclasses.replace(enc.policy, **pol))
    planner = fields_from_args(args, PlannerConfig)
    if planner:
        enc = dataclasses.replace(enc, planner=dataclasses.replace(enc.planner, **planner))
    top = fields_from_args(args, SchedulerConfig)
    if top:
        enc = dataclasses.replace(enc, **top)
    model = spec.model
    given = fields_from_args(args, ModelOptions)
    if given:
        model = dataclasses.replace(model, **given)
    spec = llm_from_args(spec, args)
    return spec.replace(encoder=enc, model=model, **fields_from_args(args, ServingOptions))


def _deployment_flag_names() -> tuple[tuple[str, str], ...]:
    """(dest, flag) of ``--config`` and each deployment flag, in --help order."""
    pairs = [("config", "--config")]
    sections = (*((cls, names) for _, cls, names in _ENCODER_FLAGS), (ServingOptions, _SERVER_FLAGS))
    for cls, names in sections:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        pairs += [(_dest(n, fields[n].metadata["flag"]), _options(n, fields[n].metadata["flag"])[0])
                  for n in names]
    return tuple(pairs)


_FLAGS = _deployment_flag_names()


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--min-cosine`` and ``--backend`` (serve): override the file's ``model:`` section."""
    g = p.add_argument_group("precision (models/precision.py)")
    add_field_flags(g, ModelOptions, section="model")


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
# llm``: each overrides the config file's ``llm:`` section (``core/llm/config.py``; docs/llm.md). In
# --help order; each field's flag metadata says how it is spelled where not --field-name.
_LLM_ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
                     "max_waiting_seqs", "max_priority_wait_s", "decode_run_tokens", "enable_chunked_prefill",
                     "enable_prefix_caching", "policy", "request_timeout_s")
_LLM_MEMORY_FLAGS = ("kv_cache_memory", "memory_utilization", "swap_space", "preemption")


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """The LLM engine's settings as flags (serve --llm, simulate --target llm): override ``llm:``."""
    g = p.add_argument_group("LLM engine (override the config file's llm: section; docs/llm.md)")
    add_field_flags(g, LLMSchedulerConfig, _LLM_ENGINE_FLAGS, section="llm", help="{key} (default {default})")
    m = p.add_argument_group("LLM memory (docs/llm.md, \"Memory planning\")")
    add_field_flags(m, LLMSchedulerConfig, _LLM_MEMORY_FLAGS, section="llm")


def _size(default_unit: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, default_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def llm_from_args(spec: DeploymentSpec, args: argparse.Namespace) -> DeploymentSpec:
    """``spec`` with the LLM flags given on this command line applied to its ``llm:`` section (the
    section's own validation names what to change)."""
    changed = fields_from_args(args, LLMSchedulerConfig)
    # a flag that sizes the pool replaces the file's way of sizing it
    if {"kv_cache_memory", "memory_utilization", "num_kv_blocks"} & set(changed):
        changed.setdefault("kv_cache_memory", None)
        changed.setdefault("memory_utilization", None)
    return (spec.replace(llm=dataclasses.replace(spec.llm, **changed), llm_given=frozenset(changed))
            if changed else spec)


