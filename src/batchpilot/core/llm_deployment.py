"""The LLM deployment, resolved once: the ``LLMSchedulerConfig`` an engine runs, and its KV plan.

    resolve_llm_deployment(spec, model, memory, free_bytes, swap_on_device)
        -> LLMDeployment(config, plan, notes)

``serve --llm`` and ``bench fidelity --workload conv-llm`` (both through
``runtime/llm_build.build_llm_engine``) and ``simulate --target llm`` (``sim/llm_memory.py``, from the
profile) all call it, so the engine the simulator runs is the one the server builds. Rules, in order
(each change is written into ``notes``, which the server logs and the simulator prints):

1. Deadline: ``llm.request_timeout_s`` when the user set it; else ``server.request_timeout_s`` when the
   user set that (in the file or with ``--request-timeout-s``); else the LLM's own default (600 s: a
   generation runs far longer than an embedding). The routes' deadline and the engine's expiry use it.
2. Concurrency: ``llm.max_waiting_seqs`` when the user set it; else, when the user set
   ``server.max_concurrency`` (``--max-concurrency``) above 0, the engine admits that many sequences
   (one per prompt): ``max_waiting_seqs = max_concurrency - max_num_seqs``, at least 0 (an engine always
   admits the ``max_num_seqs`` it runs). ``max_concurrency: 0`` (no limit) leaves the LLM's bound as it is.
3. The model: unless set, ``max_model_len`` is the model's position count and ``eos_token_ids`` its EOS
   tokens (``LLMModelLimits``; a value the model does not give leaves the section's).
4. Memory: with a ``MemoryProfile``, ``core.kv_plan.plan_kv`` sizes the pool and checks it; where
   ``max_model_len`` is the model's own, a pool too small for it lowers it to the pool's capacity.
   Without one, ``num_kv_blocks`` stands, and a memory budget is an error that says how to get one.

Pure: the drivers pass in what they measured (the memory profile and free bytes, the model's limits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.kv_plan import KVPlan, KVPlanError, MemoryProfile, plan_kv
from batchpilot.core.llm_config import LLMSchedulerConfig


@dataclass(frozen=True)
class LLMModelLimits:
    """What the model says: its position count (None: not known) and its EOS token ids."""

    max_model_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LLMDeployment:
    """The effective LLM engine: the config its scheduler and runner are built with, the KV plan (None
    when no memory profile was given), and why the config differs from the ``llm:`` section."""

    config: LLMSchedulerConfig
    plan: KVPlan | None = None
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs and reports."""
        c = self.config
        return (f"max_num_seqs {c.max_num_seqs}, {c.max_num_batched_tokens} tokens per step, max_model_len "
                f"{c.max_model_len}, policy {c.policy}; admits at most {c.max_num_seqs + c.max_waiting_seqs} "
                f"sequences ({c.max_num_seqs} running + {c.max_waiting_seqs} waiting), request timeout "
                f"{c.request_timeout_s:g} s")


def llm_settings(spec: DeploymentSpec) -> tuple[LLMSchedulerConfig, list[str]]:
    """The ``llm:`` section with the server-wide settings applied (rules 1 and 2), and the notes."""
    c, given, server = spec.llm, spec.llm_given, spec.server
    fill: dict[str, Any] = {}
    notes: list[str] = []
    if "request_timeout_s" not in given and "request_timeout_s" in spec.server_given:
        fill["request_timeout_s"] = server.request_timeout_s
        notes.append(f"llm request timeout {server.request_timeout_s:g} s (server.request_timeout_s; set "
                     f"llm.request_timeout_s to give the LLM routes their own)")
    if "max_waiting_seqs" not in given and "max_concurrency" in spec.server_given:
        if server.max_concurrency:
            waiting = max(0, server.max_concurrency - c.max_num_seqs)
            fill["max_waiting_seqs"] = waiting
            floor = (f", not fewer than the {c.max_num_seqs} it runs (max_num_seqs)"
                     if server.max_concurrency < c.max_num_seqs else "")
            notes.append(f"llm admits at most {c.max_num_seqs + waiting} sequences (server.max_concurrency "
                         f"{server.max_concurrency}{floor}): max_waiting_seqs {waiting}; set "
                         f"llm.max_waiting_seqs to give the LLM engine its own bound")
        else:
            notes.append(f"server.max_concurrency 0 (no limit) leaves the LLM engine's bound at "
                         f"{c.max_num_seqs + c.max_waiting_seqs} sequences (max_num_seqs + max_waiting_seqs)")
    return (dataclasses.replace(c, **fill) if fill else c), notes


def resolve_llm_deployment(spec: DeploymentSpec, model: LLMModelLimits | None = None,
                           memory: MemoryProfile | None = None, free_bytes: float | None = None,
                           swap_on_device: bool = True) -> LLMDeployment:
    """The effective LLM deployment (see the module docstring for the rules). ``free_bytes``: the
    device's free memory before the model loaded (None: unknown); ``swap_on_device``: host swap space
    is the same memory as the pool (CPU). Raises ``KVPlanError`` (a ``ValueError``) with what to change."""
    model = model or LLMModelLimits()
    config, notes = llm_settings(spec)
    given = spec.llm_given
    own: dict[str, Any] = {}
    if "max_model_len" not in given and model.max_model_len:
        own["max_model_len"] = int(model.max_model_len)
    if "eos_token_ids" not in given and model.eos_token_ids:
        own["eos_token_ids"] = tuple(model.eos_token_ids)
    if own:
        config = dataclasses.replace(config, **own)
    if memory is None:
        needs = [k for k in ("kv_cache_memory", "memory_utilization", "swap_space") if getattr(config, k)]
        if needs:
            raise KVPlanError(f"{', '.join(needs)} needs a profile with a 'memory' section to be planned: "
                              f"`batchpilot profile --llm -o llm.json`, then --profile llm.json")
        return LLMDeployment(config, None, tuple(notes))
    plan = plan_kv(config, memory, free_bytes, swap_on_device=swap_on_device,
                   cap_max_model_len="max_model_len" not in given)
    if plan.max_model_len != config.max_model_len:
        notes.append(f"max_model_len lowered to {plan.max_model_len}: the KV pool holds {plan.num_kv_tokens} "
                     f"tokens, fewer than the model's {config.max_model_len} positions (set max_model_len, "
                     f"or give more KV memory)")
    return LLMDeployment(plan.resolve(config), plan, tuple(notes))
