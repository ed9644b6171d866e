"""The arms of one served model: a primary and its candidates, each its own ``ModelService`` (its own
scheduler, slots and metrics) over the same weights, with the core's assignment and rollback
(``core.rollout``) and comparison (``core.abtest``).

    armed = ArmedModel.of_services([primary_svc, canary_svc], rollout)   # an LLM's: ArmedModel(engines)
    name, svc = armed.pick(request)          # X-Client-Id, else the connection (or random)
    armed.record(name, status, seconds)      # every answer; rolls a candidate back when a rule says
    armed.status()                           # GET /v1/arms: windows, comparisons, rollbacks

An answer counts by its status: 200 ok; 429 and 503 rejected (admission); 500 a fault (the executor
failed); 504 and other 5xx errors; client errors (4xx) are not the arm's doing and are not counted.
A rollback is logged (warning, with the rule and the numbers), counted in
``batchpilot_arm_rollbacks_total{arm,rule}``, shown by ``batchpilot_arm_share`` dropping to 0 and by
``/health``'s ``arms``; ``POST /v1/arms/{arm}/enable`` takes the arm back (``/disable`` rolls it back
by hand).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypedDict, TypeVar

from fastapi import APIRouter, Request
from prometheus_client import CollectorRegistry, Counter, Gauge

from batchpilot.core.abtest import ArmSample, compare_arms
from batchpilot.core.batch import Batch
from batchpilot.core.rollout import PRIMARY, ArmWindow, Outcome, Rollback, RolloutGuard, RolloutSpec, arm_for
from batchpilot.server.errors import APIError
from batchpilot.server.llm.served import ServedEngine
from batchpilot.server.metrics import ModelLabels
from batchpilot.server.service import ModelService

log = logging.getLogger("batchpilot.server")

CHECK_INTERVAL_S = 0.25  # the rules are evaluated at most this often (each check sorts the windows)
ARM_HEADER = "x-batchpilot-arm"


def outcome_of(status: int) -> Outcome | None:
    if status == 200:
        return Outcome.OK
    if status in (429, 503):
        return Outcome.REJECTED
    if status == 500:
        return Outcome.FAULT
    if status >= 500:
        return Outcome.ERROR
    return None


# What routes a request, per arm: an encoder's ``ModelService``, or an LLM's engine
Backend = TypeVar("Backend")
# A JSON object the routes answer with; nothing reads its values back, so they are only ``object``
JSONObject = dict[str, object]


class EncoderArmConfig(TypedDict):
    policy: str
    max_batch_size: int
    max_wait_s: float
    padding: str
    num_slots: int


class LLMArmConfig(TypedDict):
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int
    policy: str
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    kv_usage: float
    kv_fragmentation: float
    preemptions: int
    running: int
    waiting: int


def describe_service(svc: ModelService) -> EncoderArmConfig:
    """An encoder arm's config as ``/v1/arms`` shows it."""
    cfg = svc.batcher.config
    return {"policy": cfg.policy.name, "max_batch_size": cfg.policy.max_batch_size,
            "max_wait_s": cfg.policy.max_wait_s, "padding": cfg.planner.padding, "num_slots": cfg.num_slots}


class ArmedModel(Generic[Backend]):
    """The arms of one model over ``backends`` (primary first: an encoder's ``ModelService`` per arm,
    or an LLM's engine per arm); ``describe(backend)`` is what ``/v1/arms`` shows of each."""

    def __init__(self, model_name: str, backends: Sequence[Backend], rollout: RolloutSpec,
                 describe: Callable[[Backend], EncoderArmConfig | LLMArmConfig], seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = rollout.names()
        if len(backends) != len(names):
            raise ValueError(f"{len(backends)} backends for the arms {names}")
        self.model_name = model_name
        self.backends = dict(zip(names, backends, strict=True))
        self.describe = describe
        self.rollout = rollout
        self.base_shares = rollout.shares()
        self.guard = RolloutGuard(names, rollout.rules)
        self.clock = clock
        self._rng = random.Random(seed)
        self._shares = list(self.base_shares)
        self._last_check = -float("inf")
        self.registry = r = CollectorRegistry()
        self._share_gauge = Gauge("batchpilot_arm_share", "Share of new requests assigned to the arm",
                                  ["arm"], registry=r)
        self._rolled = Gauge("batchpilot_arm_rolled_back", "1 while the arm is rolled back", ["arm"],
                             registry=r)
        self._rollbacks = Counter("batchpilot_arm_rollbacks", "Rollbacks of the arm, by rule",
                                  ["arm", "rule"], registry=r)
        self._publish()

    @classmethod
    def of_services(cls, services: Sequence[ModelService], rollout: RolloutSpec) -> ArmedModel[ModelService]:
        """An encoder's arms: one ``ModelService`` each, their batches in the windows."""
        armed = ArmedModel(services[0].model_name, services, rollout, describe_service)
        for name, svc in armed.backends.items():
            svc.batcher.batch_observers.append(armed._batch_recorder(name))
        return armed

    def _batch_recorder(self, name: str) -> Callable[[Batch, float, float], None]:
        def record(batch: Batch, start: float, slot_s: float) -> None:
            self.guard.record_batch(name, start, batch.size, batch.shape.useful_tokens, batch.shape.tokens)
        return record

    def pick(self, request: Request) -> tuple[str, Backend]:
        key = request.headers.get("x-client-id")
        if key is None and self.rollout.assign == "client":
            client = request.scope.get("client")
            key = f"{client[0]}:{client[1]}" if client else None
        if self.rollout.assign == "random":
            key = None
        i = self.guard.route(arm_for(key, self.base_shares, self._rng.random()))
        name = self.guard.names[i]
        return name, self.backends[name]

    def record(self, arm: str, status: int, seconds: float) -> None:
        outcome = outcome_of(status)
        if outcome is None:
            return
        now = self.clock()
        self.guard.record(arm, now, seconds, outcome)
        if now - self._last_check >= CHECK_INTERVAL_S or (outcome is Outcome.FAULT and arm != PRIMARY):
            self._last_check = now
            for rb in self.guard.check(now):
                self._rolled_back(rb)

    def _rolled_back(self, rb: Rollback) -> None:
        log.warning("arm %s of %s rolled back (%s): %s; its traffic goes to the primary until "
                    "POST /v1/arms/%s/enable", rb.arm, self.model_name, rb.rule, rb.detail, rb.arm)
        self._rollbacks.labels(arm=rb.arm, rule=rb.rule).inc()
        self._publish()

    def _publish(self) -> None:
        self._shares = self.guard.shares(self.base_shares)
        for name, share in zip(self.guard.names, self._shares, strict=True):
            self._share_gauge.labels(arm=name).set(share)
            self._rolled.labels(arm=name).set(1.0 if name in self.guard.rolled_back else 0.0)

    def enable(self, arm: str) -> bool:
        """Take a rolled-back candidate back (its window starts empty); False if it was serving."""
        self._known(arm)
        done = self.guard.enable(arm)
        if done:
            log.info("arm %s of %s enabled again", arm, self.model_name)
            self._publish()
        return done

    def disable(self, arm: str) -> bool:
        """Roll a candidate back by hand; False if it already was."""
        self._known(arm)
        if arm == PRIMARY:
            raise ValueError("the primary arm cannot be rolled back: it is where traffic returns to")
        if arm in self.guard.rolled_back:
            return False
        rb = Rollback(arm, self.clock(), "manual", "rolled back by POST /v1/arms/{arm}/disable")
        self.guard.rolled_back[arm] = rb
        self._rolled_back(rb)
        return True

    def _known(self, arm: str) -> None:
        if arm not in self.backends:
            raise KeyError(f"{self.model_name} has no arm {arm!r}; its arms are {', '.join(self.backends)}")

    def states(self) -> dict[str, str]:
        return {n: "rolled_back" if n in self.guard.rolled_back else "serving" for n in self.guard.names}

    def windows(self) -> dict[str, ArmWindow]:
        """Every arm's window now (on the event loop, where the answers are recorded)."""
        now = self.clock()
        return {n: self.guard.window(n, now) for n in self.guard.names}

    def status(self, windows: dict[str, ArmWindow], resamples: int = 500) -> JSONObject:
        """The windows and each candidate against the primary (a bootstrap: may run off the loop)."""
        now = self.clock()
        arms: list[JSONObject] = []
        for (name, w), share, base in zip(windows.items(), self._shares, self.base_shares, strict=True):
            rb = self.guard.rolled_back.get(name)
            arms.append({
                "arm": name, "state": "rolled_back" if rb else "serving", "share": share, "base_share": base,
                "config": self.describe(self.backends[name]),
                "window_s": self.guard.rules.window_s, "answers": w.total, "ok": len(w.latencies),
                "p50_s": _num(w.p(0.5)), "p99_s": _num(w.p(0.99)), "error_rate": w.error_rate,
                "rejection_rate": w.rejection_rate, "faults": w.faults, "batches": w.batches,
                "mean_batch_size": _num(w.mean_batch_size), "padding_efficiency": _num(w.padding_efficiency),
                "rollback": None if rb is None else {"rule": rb.rule, "detail": rb.detail,
                                                     "seconds_ago": now - rb.at}})
        primary = windows[PRIMARY]
        comparisons = [compare_arms(ArmSample(PRIMARY, primary.latencies, primary.errors + primary.faults,
                                              primary.rejected),
                                    ArmSample(n, w.latencies, w.errors + w.faults, w.rejected),
                                    resamples=resamples).to_dict()
                       for n, w in windows.items() if n != PRIMARY]
        return {"model": self.model_name, "assign": self.rollout.assign,
                "rules": dict(vars(self.guard.rules)), "arms": arms, "comparisons": comparisons}


def _num(x: float) -> float | None:
    return None if x != x else x  # NaN -> null in JSON


# The arms' routes (mounted when a model is served in arms; behind the API key like every route but
# /health):
#
#     GET  /v1/arms                        every armed model: each arm's window (answers, P50, P99, error
#                                          and rejection rates, batches, padding efficiency), each candidate
#                                          compared with the primary (``core.abtest``), the rollbacks
#     POST /v1/arms/{arm}/enable?model=M   take a rolled-back candidate back
#     POST /v1/arms/{arm}/disable?model=M  roll a candidate back by hand
#
# ``model`` may be left out when one model is served in arms.

# a model served in arms: an encoder's (over its services) or the LLM's (over its engines)
AnyArmed = ArmedModel[ModelService] | ArmedModel[ServedEngine]


def arms_router(models: Sequence[AnyArmed]) -> APIRouter:
    """The routes over every model served in arms (the encoders' and the LLM's)."""
    router = APIRouter()
    by_name = {a.model_name: a for a in models}
    one_at_a_time = asyncio.Lock()  # each status runs bootstraps: concurrent GETs queue, not pile up

    def armed(model: str | None) -> AnyArmed:
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
    async def arms_status() -> JSONObject:
        loop = asyncio.get_running_loop()  # the bootstrap takes a while: off the event loop
        async with one_at_a_time:
            status = [await loop.run_in_executor(None, a.status, a.windows()) for a in models]
        return {"object": "list", "data": status}

    async def change(arm: str, model: str | None, enable: bool) -> JSONObject:
        target = armed(model)
        try:
            changed = target.enable(arm) if enable else target.disable(arm)
        except KeyError as exc:
            raise APIError(404, str(exc.args[0]), code="arm_not_found", param="arm") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="arm") from None
        return {"model": target.model_name, "arm": arm, "changed": changed, "states": target.states()}

    @router.post("/v1/arms/{arm}/enable")
    async def enable(arm: str, model: str | None = None) -> JSONObject:
        return await change(arm, model, True)

    @router.post("/v1/arms/{arm}/disable")
    async def disable(arm: str, model: str | None = None) -> JSONObject:
        return await change(arm, model, False)

    return router


# The LLM served in arms: an engine per arm (each its own scheduler config, paged KV cache and engine
# thread) over the same weights, assigned, compared and rolled back by the same ``ArmedModel`` as the
# encoders' arms (``server/arms.py``).
#
#     arms = LLMArms([primary_engine, canary_engine], rollout)
#     make_llm_router(primary_engine, registry, arms=arms)     # picks the arm of each request
#
# A request's outcome is recorded when its response starts: for a stream the time to its first token,
# otherwise the whole answer. ``/v1/arms`` shows each arm's engine settings beside its KV use, KV
# fragmentation, preemptions and queue, read from the engine when asked. Every LLM series carries
# ``arm=<name>``; the arm series (share, rollbacks) carry ``model=<the LLM's name>``.

def describe_engine(engine: ServedEngine) -> LLMArmConfig:
    """An LLM arm's settings and its KV cache now, as ``/v1/arms`` shows them."""
    c, s = engine.config, engine.stats()
    return {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
            "num_kv_blocks": c.num_kv_blocks, "block_size": c.block_size, "policy": c.policy,
            "enable_chunked_prefill": c.enable_chunked_prefill,
            "enable_prefix_caching": c.enable_prefix_caching,
            "kv_usage": s.kv_usage, "kv_fragmentation": s.fragmentation, "preemptions": s.num_preemptions,
            "running": s.num_running, "waiting": s.num_waiting}


class LLMArms:
    def __init__(self, engines: Sequence[ServedEngine], rollout: RolloutSpec) -> None:
        self.armed: ArmedModel[ServedEngine] = ArmedModel(engines[0].model_name, engines, rollout,
                                                          describe_engine)
        self.registries = {name: CollectorRegistry() for name in self.armed.backends}

    @property
    def engines(self) -> dict[str, ServedEngine]:
        return self.armed.backends

    def register(self, registry: CollectorRegistry) -> dict[str, CollectorRegistry]:
        """Show every arm's series on the server's ``registry``, labelled; each arm's own registry (its
        ``LLMMetrics`` go there)."""
        sources = [({"arm": name}, reg) for name, reg in self.registries.items()]
        registry.register(ModelLabels([*sources, ({"model": self.armed.model_name}, self.armed.registry)]))
        return self.registries

    def shutdown(self, timeout: float = 10.0) -> None:
        for engine in self.engines.values():
            engine.shutdown(timeout)
