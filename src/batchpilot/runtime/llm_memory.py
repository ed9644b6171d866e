"""The engine's memory plan at start-up: which ``MemoryProfile`` feeds the deployment's KV plan
(``core.llm_deployment.resolve_llm_deployment``, which runs ``core.kv_plan.plan_kv`` on it).

* a profile file from ``batchpilot profile --llm`` (its ``"memory"`` section): measured before the
  run, checked to be of this model and precision (same KV bytes per token);
* else, when the pool is sized from a budget (``kv_cache_memory`` / ``memory_utilization``), the
  activation peak is measured here, on a probe runner over the same weights with a small pool
  (``models/llm/memory_profile.measure_memory``, a second or two);
* else the model's tensors alone (weights and KV bytes exact, no activation term): ``num_kv_blocks``
  is kept and only checked.

The deployment's notes and plan are logged; the plan is kept on the engine (``engine.memory_plan``) for
``/metrics``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.kv_plan import MemoryProfile
from batchpilot.core.llm_config import LLMSchedulerConfig
from batchpilot.core.llm_deployment import LLMDeployment, LLMModelLimits, resolve_llm_deployment

log = logging.getLogger("batchpilot.llm")

PROBE_TOKENS = 4096  # the probe runner's KV pool: enough for the measured shapes, small for big models


def load_memory_profile(path: str | Path) -> MemoryProfile:
    """The ``"memory"`` section of an LLM profile file."""
    data = json.loads(Path(path).read_text())
    if "memory" not in data:
        raise ValueError(f"{path}: no 'memory' section; write the profile with `batchpilot profile --llm`")
    return MemoryProfile.from_dict(data["memory"])


def engine_memory(weights: Any, config: LLMSchedulerConfig, device: str, dtype: Any,
                  profile: MemoryProfile | str | Path | None = None, overhead_bytes: float = 0.0
                  ) -> MemoryProfile:
    """The ``MemoryProfile`` the plan is made from (see the module docstring); ``overhead_bytes``: what
    loading this model cost beyond its weights, measured by the builder (a profile brings its own)."""
    import dataclasses

    from batchpilot.models.llm.memory_profile import measure_memory, weights_memory
    from batchpilot.models.llm.model_runner import LLMModelRunner

    exact = dataclasses.replace(weights_memory(weights, dtype), overhead_bytes=overhead_bytes)
    if profile is not None:
        mem = profile if isinstance(profile, MemoryProfile) else load_memory_profile(profile)
        if mem.kv_bytes_per_token != exact.kv_bytes_per_token:
                raise ValueError(f"the memory profile has {mem.kv_bytes_per_token} KV bytes per token, this "
                                 f"model in {dtype} has {exact.kv_bytes_per_token}: it was profiled for "
                                 f"another model or precision; profile this one with "
                                 f"`batchpilot profile --llm`")
        return mem
    if config.kv_cache_memory is None and config.memory_utilization is None:
        return exact
    probe = LLMModelRunner(weights, max(1, PROBE_TOKENS // config.block_size), config.block_size,
                           device=device, dtype=dtype)
    mem, _ = measure_memory(probe)
    del probe
    log.info("llm memory: measured the activation peak at start-up: %.0f B + %.0f B per batched token "
             "+ %.0f B per gathered context token", mem.activation_fixed_bytes,
             mem.activation_bytes_per_token, mem.activation_bytes_per_read_token)
    return dataclasses.replace(mem, overhead_bytes=overhead_bytes)


def plan_engine_memory(weights: Any, spec: DeploymentSpec, model: LLMModelLimits, device: str, dtype: Any,
                       free_bytes: float | None, profile: MemoryProfile | str | Path | None = None,
                       overhead_bytes: float = 0.0) -> tuple[LLMDeployment, MemoryProfile]:
    """The engine's deployment (``core.llm_deployment.resolve_llm_deployment`` on this memory), logged;
    raises ``core.kv_plan.KVPlanError`` with what to change."""
    mem = engine_memory(weights, spec.llm, device, dtype, profile, overhead_bytes)
    dep = resolve_llm_deployment(spec, model, mem, free_bytes, swap_on_device=str(device).startswith("cpu"))
    for note in dep.notes:
        log.info("llm deployment: %s", note)
    log.info("llm deployment: %s", dep.describe())
    if dep.plan is not None:  # always: a memory profile was given
        log.info("llm memory: %s", dep.plan.describe())
    return dep, mem


def profile_engine_memory(engine: Any, burst_seqs: int = 32, burst_prompt: int = 128,
                          burst_output: int = 16) -> tuple[MemoryProfile, list[dict[str, float]]]:
    """What ``batchpilot profile --llm`` records of a built (not started) engine, in this order, each
    before the next leaves pages of its own resident:

    1. the built engine's overhead beyond weights and KV (``llm_build.built_overhead``);
    2. a burst of ``burst_seqs`` requests (token-id prompts, greedy, EOS ignored) through the started
       engine: on CPU, what it leaves resident beyond the activation peak the plan counts for such a
       burst (the engine thread's arena, the requests' Python state) joins the overhead;
    3. the activation terms (``models/llm/memory_profile.measure_memory``) on its runner.

    The engine is shut down at the end; its runner stays usable (the step profile runs on it next)."""
    import asyncio
    import dataclasses

    from batchpilot.core.llm_plan import decode_groups
    from batchpilot.core.sequence import SamplingParams
    from batchpilot.models.device import used_memory_bytes
    from batchpilot.models.llm.memory_profile import measure_memory
    from batchpilot.runtime.llm_build import built_overhead

    overhead = built_overhead(engine)
    device = engine.runner.device
    params = SamplingParams(max_tokens=burst_output, temperature=0.0, ignore_eos=True)

    async def burst() -> None:
        async def one(i: int) -> None:
            async for _ in engine.generate([7 + (i * 31 + j) % 256 for j in range(burst_prompt)], params):
                pass
        await asyncio.gather(*(one(i) for i in range(burst_seqs)))

    before = used_memory_bytes(device)
    engine.start()
    try:
        asyncio.run(burst())
    finally:
        engine.shutdown()
    grown = used_memory_bytes(device) - before
    memory, points = measure_memory(engine.runner)
    if device.type == "cpu":
        ctx = [burst_prompt + burst_output] * burst_seqs
        runs = decode_groups(ctx, engine.config.decode_run_tokens)
        group = max(b - a for a, b in runs)  # the largest gather, as the plan counts
        burst_activation = memory.activation_bytes(engine.config.max_num_batched_tokens, group * ctx[0])
        overhead += max(0.0, grown - burst_activation)
    return dataclasses.replace(memory, overhead_bytes=overhead), points
