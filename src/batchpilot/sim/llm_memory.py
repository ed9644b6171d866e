"""The simulated engine's deployment: ``core.llm_deployment.resolve_llm_deployment`` on the profile, as
serve resolves it on the machine.

``batchpilot profile --llm`` writes the measured ``memory`` section, the device's free memory
(``free_bytes``) and the model's position count (``model_max_len``) into the profile;
``planned_llm_config`` resolves the deployment from them, so ``simulate --target llm`` runs the engine
``serve --llm --llm-profile`` would build on that machine: the same KV pool, length, request timeout
and admission bound. A profile without a memory section (or none) leaves ``num_kv_blocks`` as given; a
memory budget then needs one.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.kv_plan import MemoryProfile
from batchpilot.core.llm_deployment import LLMDeployment, LLMModelLimits, resolve_llm_deployment


def planned_llm_config(spec: DeploymentSpec, profile: str | Path | None) -> LLMDeployment:
    """The deployment of ``spec``'s ``llm:`` section on the profile's machine (its ``plan`` None when the
    profile has no memory section). Raises ``ValueError`` (``KVPlanError``) with what to change."""
    data = json.loads(Path(profile).read_text()) if profile else {}
    memory = MemoryProfile.from_dict(data["memory"]) if "memory" in data else None
    model = LLMModelLimits(int(data["model_max_len"]) if data.get("model_max_len") else None)
    return resolve_llm_deployment(spec, model, memory, data.get("free_bytes"),
                                  swap_on_device=data.get("device", "cpu") == "cpu")
