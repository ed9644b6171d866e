"""The arms' routes (mounted when a model is served in arms; behind the API key like every route but
/health):

    GET  /v1/arms                        every armed model: each arm's window (answers, P50, P99, error
                                         and rejection rates, batches, padding efficiency), each candidate
                                         compared with the primary (``core.abtest``), the rollbacks
    POST /v1/arms/{arm}/enable?model=M   take a rolled-back candidate back
    POST /v1/arms/{arm}/disable?model=M  roll a candidate back by hand

``model`` may be left out when one model is served in arms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from batchpilot.server.arms import ArmedModel
from batchpilot.server.errors import APIError


def arms_router(models: Sequence[ArmedModel]) -> APIRouter:
    """The routes over every model served in arms (the encoders' and the LLM's)."""
    router = APIRouter()
    by_name = {a.model_name: a for a in models}
    one_at_a_time = asyncio.Lock()  # each status runs bootstraps: concurrent GETs queue, not pile up

    def armed(model: str | None) -> ArmedModel:
        if model is None:
            if len(by_name) == 1:
                return next(iter(by_name.values()))
            raise APIError(400, f"give ?model=, one of {', '.join(by_name)}", param="model")
        found = by_name.get(model)
        if found is None:
            raise APIError(404, f"{model!r} is not served in arms; these are: {', '.join(by_name)}",
                           code="model_not_found", param="model")
        return found

    @router.get("/v1/arms")
    async def arms_status() -> dict[str, Any]:
        loop = asyncio.get_running_loop()  # the bootstrap takes a while: off the event loop
        async with one_at_a_time:
            status = [await loop.run_in_executor(None, a.status, a.windows()) for a in models]
        return {"object": "list", "data": status}

    async def change(arm: str, model: str | None, enable: bool) -> dict[str, Any]:
        target = armed(model)
        try:
            changed = target.enable(arm) if enable else target.disable(arm)
        except KeyError as exc:
            raise APIError(404, str(exc.args[0]), code="arm_not_found", param="arm") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="arm") from None
        return {"model": target.model_name, "arm": arm, "changed": changed, "states": target.states()}

    @router.post("/v1/arms/{arm}/enable")
    async def enable(arm: str, model: str | None = None) -> dict[str, Any]:
        return await change(arm, model, True)

    @router.post("/v1/arms/{arm}/disable")
    async def disable(arm: str, model: str | None = None) -> dict[str, Any]:
        return await change(arm, model, False)

    return router
