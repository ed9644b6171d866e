"""The simulated engine's KV pool: ``core.kv_plan.plan_kv`` run on the profile's memory, as serve runs it.

``batchpilot profile --llm`` writes the measured ``memory`` section and the device's free memory
(``free_bytes``) into the profile; ``planned_llm_config`` plans the ``llm:`` section from them, so
``simulate --target llm`` runs the pool ``serve --llm --llm-profile`` would build on that machine. A
profile without a memory section (or none) leaves ``num_kv_blocks`` as given; a memory budget then needs
one.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.kv_plan import KVPlan, MemoryProfile, plan_kv
from ..core.llm_config import LLMSchedulerConfig


def planned_llm_config(config: LLMSchedulerConfig, profile: str | Path | None
                       ) -> tuple[LLMSchedulerConfig, KVPlan | None]:
    """``config`` with the planned block counts, and the plan (None when nothing could be planned).
    Raises ``ValueError`` (``KVPlanError``) with what to change."""
    data = json.loads(Path(profile).read_text()) if profile else {}
    if "memory" not in data:
        if config.kv_cache_memory is not None or config.memory_utilization is not None:
            raise ValueError("a memory budget (kv_cache_memory / memory_utilization) needs a profile with a "
                             "'memory' section: `batchpilot profile --llm -o llm.json`, then "
                             "--profile llm.json")
        return config, None
    plan = plan_kv(config, MemoryProfile.from_dict(data["memory"]), data.get("free_bytes"),
                   swap_on_device=data.get("device", "cpu") == "cpu")
    return plan.resolve(config), plan
