"""The Ray Serve deployment: one replica = one ``build_app`` app, its own Batchers inside.

    BatchpilotReplica(settings, spec, max_ongoing, rollout)
        __init__                   build_app(settings, spec, rollout): load the models, resolve each
                                   deployment (``core.deployment``) and arm, the app ``batchpilot
                                   serve`` runs; then
                                   check ``max_ongoing`` against the resolved configs (``ray/limits.py``)
        __serve_build_asgi_app__   that app (late-bound ``@serve.ingress()``), every response carrying
                                   ``x-batchpilot-replica: <pid>`` (which replica answered)
        record_autoscaling_stats   ``server.ray.autoscale.replica_stats`` of its schedulers (the policy's
        input)

Scale-down and shutdown lose nothing queued: Serve stops routing to the replica and waits for its
ongoing HTTP requests (every request the core holds is one, queued or running) for up to
``graceful_shutdown_timeout_s`` (the deployment sets it to ``--drain-timeout-s``); then the app's
lifespan shuts the Batchers down with the same drain timeout (``ModelService.close``).

Batching is batchpilot's (not ``@serve.batch``): Serve only routes HTTP requests to replicas; what is
admitted, queued, batched and refused is each replica's core. Imports Ray: loaded only with ``--ray``
or by ``serve run``.
"""

from __future__ import annotations

import logging
import os
import time

from ray import serve
from starlette.types import Message, Receive, Scope, Send

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.rollout import RolloutSpec
from batchpilot.server.config import ServerConfig
from batchpilot.server.middleware import RequestLifecycle
from batchpilot.server.ray.autoscale import replica_stats
from batchpilot.server.ray.limits import check_max_ongoing

log = logging.getLogger("batchpilot.server")

REPLICA_HEADER = b"x-batchpilot-replica"



class ReplicaHeader:
    """ASGI: the wrapped app, with ``x-batchpilot-replica: <pid>`` on every HTTP response."""

    def __init__(self, app: RequestLifecycle, pid: int) -> None:
        self.app = app
        self.state = app.state
        self.value = str(pid).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REPLICA_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)


def served_configs(app: RequestLifecycle) -> list[tuple[str, SchedulerConfig]]:
    """``(model name, resolved SchedulerConfig)`` of every model the app serves."""
    return [(s.model_name, s.batcher.scheduler.config) for s in app.state.models.services]


@serve.ingress()
class BatchpilotReplica:
    def __init__(self, settings: ServerConfig, spec: DeploymentSpec, max_ongoing: int,
                 rollout: RolloutSpec | None = None) -> None:
        from batchpilot.server import logs
        from batchpilot.server.build import build_app

        logs.configure(settings.log_level, "text")
        self.served = build_app(settings, spec, rollout)  # (``app`` is Serve's)
        self.settings = settings
        configs = served_configs(self.served)
        check_max_ongoing(max_ongoing, configs)  # the authority: the configs this replica resolved
        self.schedulers = [s.batcher.scheduler for s in self.served.state.models.services]
        models = ", ".join(f"{n} (batch {c.policy.max_batch_size} x {c.num_slots} slots)" for n, c in configs)
        log.info("ray replica %d: %s, max_ongoing_requests %d", os.getpid(), models, max_ongoing)

    def __serve_build_asgi_app__(self) -> ReplicaHeader:
        return ReplicaHeader(self.served, os.getpid())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return replica_stats(self.schedulers, time.monotonic())
