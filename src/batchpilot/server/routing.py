"""Which served model answers a request: by the body's ``model``, else the first model of the route's
task; and the one place a route's errors and HTTP metrics are handled.

    ModelRoute(models, "/v1/rerank", RerankRequest, ("score",), "rerank")(request) -> Response

parses the body from the bytes (pydantic-core), picks the service (``Models.pick``: an unknown model
is 404, a model of another task 400, both naming what this server serves), awaits its method, and
counts the answer on that model's ``http_requests_total{route,status}`` and latency histogram (on the
route's default model when none was picked). A model served in arms (``server/arms.py``) has the
request assigned to one of them, which answers it, names itself in the ``X-Batchpilot-Arm`` response
header and records the outcome for the arms' comparison and rollback; when a candidate's executor
fails (500), the primary answers the request, and the candidate is charged a fault only if the
primary succeeded (else the input was at fault); a retried answer stays out of the primary's window
(its time includes the candidate's attempt). An unexpected exception
propagates to the request middleware's fixed 500.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from batchpilot.core.rollout import PRIMARY
from batchpilot.server.arms import ARM_HEADER, ArmedModel
from batchpilot.server.errors import APIError, error_response, request_id_of, validation_response
from batchpilot.server.service import RECEIVED_KEY, ClientGone, ModelService

# the routes of each task (several paths where the APIs users come from differ)
TASK_ROUTES = {
    "embed": ("/v1/embeddings",),
    "score": ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"),
    "classify": ("/v1/classify", "/classify"),
}
_UNARMED = ("tokenize_text", "detokenize")  # answered by the primary, not compared across arms
_ROUTE_NAMES = {"embed": "embeddings", "score": "rerank and score", "classify": "classify"}


class Models:
    """The served models, in the order given (the first of a task is that task's default); ``services``
    are their primaries, ``arms`` the models served in arms, ``all_services`` every arm's service."""

    def __init__(self, services: Sequence[ModelService], arms: Sequence[ArmedModel[ModelService]] = ()
                 ) -> None:
        if not services:
            raise ValueError("a server needs at least one model")
        self.services = list(services)
        self.arms = {a.model_name: a for a in arms}
        self.all_services = [a for s in services for a in
                             (self.arms[s.model_name].backends.values() if s.model_name in self.arms
                              else [s])]
        self.by_name: dict[str, ModelService] = {}
        for svc in services:
            if svc.model_name in self.by_name:
                raise ValueError(f"two models are named {svc.model_name!r}; give each a distinct "
                                 "--model-name")
            self.by_name[svc.model_name] = svc

    @property
    def primary(self) -> ModelService:
        return self.services[0]

    def of_task(self, tasks: Sequence[str]) -> list[ModelService]:
        return [s for s in self.services if s.task in tasks]

    def describe(self) -> str:
        return ", ".join(f"{s.model_name!r} ({s.task})" for s in self.services)

    def pick(self, tasks: Sequence[str], name: str | None) -> ModelService:
        if name is not None:
            svc = self.by_name.get(name)
            if svc is None:
                raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                    f"{self.describe()}", code="model_not_found", param="model")
            if svc.task not in tasks:
                raise APIError(400, f"{name!r} is a {svc.task} model and has no "
                                    f"{' or '.join(_ROUTE_NAMES[t] for t in tasks)} route; this server "
                                    f"serves {self.describe()}", code="unsupported_task", param="model")
            return svc
        fit = self.of_task(tasks)
        if not fit:
            what = " or ".join(_ROUTE_NAMES[t] for t in tasks)
            raise APIError(404, f"this server has no model for {what}; it serves {self.describe()}",
                           code="model_not_found", param="model")
        return fit[0]


class ModelRoute:
    """One route's handler: ``await route(request) -> Response``, errors included."""

    def __init__(self, models: Models, route: str, body_type: type[BaseModel], tasks: Sequence[str],
                 method: str) -> None:
        self.models = models
        self.route = route
        self.body_type = body_type
        self.tasks = tuple(tasks)
        self.method = method
        fit = models.of_task(self.tasks)
        self.default = fit[0] if fit else models.primary  # where an answer no model took is counted

    async def __call__(self, request: Request) -> Response:
        t0, status, svc = time.perf_counter(), 200, self.default
        armed: ArmedModel[ModelService] | None = None
        arm, retried = "", False
        try:
            try:
                body = self.body_type.model_validate_json(await request.body())
            except ValidationError as exc:
                status = 422
                return validation_response(exc.errors(include_url=False, include_context=False))
            svc = self.models.pick(self.tasks, getattr(body, "model", None))
            armed = self.models.arms.get(svc.model_name) if self.method not in _UNARMED else None
            if armed is not None:
                arm, svc = armed.pick(request)
                # a retry on the primary keeps the request's deadline (ModelService.deadline reads it)
                request.scope[RECEIVED_KEY] = time.monotonic()
            try:
                response: Response = await getattr(svc, self.method)(body, request)
            except APIError as exc:  # a candidate's executor failed: the primary answers instead
                if armed is None or arm == PRIMARY or exc.status != 500:
                    raise
                failed, failed_s = arm, time.perf_counter() - t0
                svc.count(self.route, 500, failed_s)  # the candidate's own series shows its failure
                arm, svc, retried = PRIMARY, armed.backends[PRIMARY], True
                response = await getattr(svc, self.method)(body, request)
                # the primary answered what the candidate could not: the candidate's fault (had the
                # primary failed too, the input was at fault and the candidate is not charged)
                armed.record(failed, 500, failed_s)
            if armed is not None:
                response.headers[ARM_HEADER] = arm
            return response
        except APIError as exc:
            status = exc.status
            out = error_response(exc, request_id_of(request))
            if armed is not None:
                out.headers[ARM_HEADER] = arm
            return out
        except ClientGone:
            status = 499
            return Response(status_code=499)
        except Exception:
            status = 500
            raise
        finally:
            seconds = time.perf_counter() - t0
            svc.count(self.route, status, seconds)
            if armed is not None and not retried:  # a retried answer stays out of the primary's window
                armed.record(arm, status, seconds)
