"""The simulated engine's KV pool: ``core.kv_plan.plan_kv`` run on the profile's memory, as serve runs it.

``batchpilot profile --llm`` writes the measured ``memory`` section and the device's free memory
(``free_bytes``) into the profile; ``planned_llm_config`` plans the ``llm:`` section from them, so
``simulate --target llm`` runs the pool ``serve --llm --llm-profile`` would build on that machine. A
profile without a memory section (or none) leaves ``num_kv_blocks`` as given; a memory budget then needs
one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..core.kv_plan import KVPlan, MemoryProfile, plan_kv
from ..core.llm_config import LLMSchedulerConfig


def planned_llm_config(config: LLMSchedulerConfig, profile: str | Path | None,
                       max_model_len_given: bool = True) -> tuple[LLMSchedulerConfig, KVPlan | None]:
    """``config`` with the planned block counts, and the plan (None when nothing could be planned).
    ``max_model_len_given`` False: as serve, the model's own position count (the profile's
    ``model_max_len``) is the length, lowered to what a smaller pool holds. Raises ``ValueError``
    (``KVPlanError``) with what to change."""
    data = json.loads(Path(profile).read_text()) if profile else {}
    if "memory" not in data:
        needs = [k for k in ("kv_cache_memory", "memory_utilization", "swap_space") if getattr(config, k)]
        if needs:
            raise ValueError(f"{', '.join(needs)} needs a profile with a 'memory' section to be planned: "
                             f"`batchpilot profile --llm -o llm.json`, then --profile llm.json")
        return config, None
    if not max_model_len_given and data.get("model_max_len"):
        config = dataclasses.replace(config, max_model_len=int(data["model_max_len"]))
    plan = plan_kv(config, MemoryProfile.from_dict(data["memory"]), data.get("free_bytes"),
                   swap_on_device=data.get("device", "cpu") == "cpu",
                   cap_max_model_len=not max_model_len_given)
    return plan.resolve(config), plan
