"""``batchpilot serve --ray``: the app ``batchpilot serve`` builds, as a Ray Serve deployment of N
replicas (or an autoscaled range), each with its own Batchers; and the app builder ``serve run`` and
``serve deploy`` call.

    batchpilot serve --ray --replicas 2 --noop --noop-delay-ms 20
    batchpilot serve --ray --autoscale 1:4 --model PATH --config tuned.yaml
    serve run batchpilot.server.ray.app:app_builder flags="--noop --noop-delay-ms 20 --replicas 2"

Every ``batchpilot serve`` flag keeps its meaning (the deployment resolved in each replica is the one
``batchpilot serve`` would run); the flags of ``add_ray_args`` say how many replicas and how they are
routed to. What the deployment is given:

* ``max_ongoing_requests``: derived from the resolved scheduler configs (``ray_limits``: every model's
  max batch size x slots plus the queue its core allows), or ``--max-ongoing-requests``, refused at
  start-up when it would cap a batch (Serve's default, 5, would);
* ``graceful_shutdown_timeout_s`` = ``--drain-timeout-s``: a replica scaled down or stopped first
  answers every request it holds;
* ``--autoscale MIN:MAX``: the custom policy ``server.ray.autoscale.BatchpilotAutoscalingPolicy`` (the core's
  ``Autoscaler`` on each replica's queue depth and predicted queue wait);
* the ingress: HAProxy (``--ingress haproxy``, the default) where its binary runs here, else Serve's
  Python proxy with the reason logged; Serve's listener on ``--host``/``--port``; Ray's dashboard off
  (``ray_cluster``).

This module imports Ray only when it runs (``add_ray_args`` does not), so ``batchpilot serve --help``
works without it. The Serve pieces are in ``ray_replica`` (the deployment), ``ray_cluster`` (Ray,
the ingress, the listener) and ``ray_autoscale`` (the policy).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, ServingOptions, resolve_deployment
from batchpilot.server.config import ServerConfig

# How many requests Ray Serve may hand one replica at once (``max_ongoing_requests``), from the
# resolved deployment's scheduler configs, and the check of a value the user gave.
#
# Ray Serve routes at most ``max_ongoing_requests`` HTTP requests to a replica at a time and queues the
# rest in its router or proxy (default 5). batchpilot's Batcher can only batch what it holds, so a
# replica must be allowed, per served model:
#
#     max_batch_size x num_slots        enough requests to fill a batch on every slot
#   + the queue the core allows         admission.max_concurrent_requests (what ``server.max_concurrency``
#                                       fills in), else admission.max_queued_requests, else the stated
#                                       default concurrency (``ServingOptions.max_concurrency``)
#
# summed over the models the replica serves. With it, every request past Ray's limit would also have
# been refused by the core, so what is admitted, queued and refused stays the core's decision.
#
# A value below ``max_batch_size x num_slots`` of some model would cap that model's batches below the
# configured size: ``check_max_ongoing`` refuses it with the numbers. A value between the two is allowed
# with a warning (Ray then queues work in front of the core's admission). Pure: no Ray import.

@dataclass(frozen=True)
class OngoingNeed:
    """What one model needs from ``max_ongoing_requests``: ``batches`` (max batch size x slots) and
    ``queue`` (what the core admits beyond them)."""

    name: str
    batches: int
    queue: int

    @property
    def total(self) -> int:
        return self.batches + self.queue


def need_of(name: str, config: SchedulerConfig) -> OngoingNeed:
    adm = config.admission
    queue = adm.max_concurrent_requests or adm.max_queued_requests or ServingOptions.max_concurrency
    return OngoingNeed(name, config.policy.max_batch_size * config.num_slots, queue)


def required_max_ongoing(configs: Sequence[tuple[str, SchedulerConfig]]) -> int:
    """The derived ``max_ongoing_requests``: every model's batches plus the queue its core allows."""
    return sum(need_of(name, cfg).total for name, cfg in configs)


def check_max_ongoing(explicit: int | None, configs: Sequence[tuple[str, SchedulerConfig]]
                      ) -> tuple[int, str | None]:
    """``(value to deploy with, warning or None)``; raises ``ValueError`` when ``explicit`` would cap a
    model's batches. ``explicit`` None: the derived value."""
    needs = [need_of(name, cfg) for name, cfg in configs]
    derived = sum(n.total for n in needs)
    if explicit is None:
        return derived, None
    if explicit < 1:
        raise ValueError(f"--max-ongoing-requests must be >= 1, got {explicit}")
    for n in needs:
        if explicit < n.batches:
            raise ValueError(
                f"--max-ongoing-requests {explicit} would cap model {n.name}'s batches: Ray Serve hands "
                f"a replica at most {explicit} requests at a time, but its deployment batches up to "
                f"{n.batches} (max_batch_size x num_slots). Give at least {n.batches}, or leave the flag "
                f"out to use the derived {derived} (batches plus the {n.queue} requests its core queues)")
    if explicit < derived:
        return explicit, (f"max_ongoing_requests {explicit} is below the derived {derived}: requests past "
                          f"{explicit} per replica wait in Ray's router, before batchpilot's admission")
    return explicit, None


log = logging.getLogger("batchpilot.server")

APP_NAME = "batchpilot"


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray Serve scale-out (docs/ray.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve as a Ray Serve deployment: several replicas, each with its own batcher")
    g.add_argument("--replicas", type=int, default=1, help="--ray: fixed number of replicas (default 1)")
    g.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="--ray: scale between MIN and MAX replicas on the replicas' predicted queue wait")
    g.add_argument("--target-queue-wait-ms", type=float, default=250.0,
                   help="--autoscale: the predicted queue wait per replica to aim at (default 250)")
    g.add_argument("--upscale-delay-s", type=float, default=5.0,
                   help="--autoscale: how long a wish to scale up must hold (default 5)")
    g.add_argument("--downscale-delay-s", type=float, default=30.0,
                   help="--autoscale: how long a wish to scale down must hold (default 30)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="--ray: CPUs Ray reserves per replica (default 1)")
    g.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="--ray: requests Ray hands one replica at once (default: derived from the "
                        "deployment: max batch size x slots + the queue the core allows; less than "
                        "max batch size x slots is refused)")
    g.add_argument("--ingress", choices=("haproxy", "python"), default="haproxy",
                   help="--ray: HAProxy (default, where it runs here) or Serve's Python proxy")
    g.add_argument("--ray-address", default=None,
                   help="--ray: join this Ray cluster (default: start a local one)")
    g.add_argument("--ray-num-cpus", type=float, default=None,
                   help="--ray: CPUs of the local Ray instance (default: the machine's)")


def parse_autoscale(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise SystemExit(f"batchpilot serve: --autoscale wants MIN:MAX (two integers), got {text!r}"
                         ) from None
    return lo, hi


def driver_configs(settings: ServerConfig, spec: DeploymentSpec) -> list[tuple[str, SchedulerConfig]]:
    """The scheduler configs each replica will resolve, as far as ``max_ongoing_requests`` reads them
    (batch size, slots, admission: they come from the spec, not from the model or the cost model), so
    the driver can refuse a bad value before any replica loads a model."""
    out = []
    for i, model in enumerate(settings.models):
        limits = ModelLimits(settings.max_length or 512, True, 0.0)
        resolved = resolve_deployment(spec, CostModel.default_cpu_minilm(), limits).scheduler
        out.append((model.name or model.path or f"model{i}", resolved))
    return out


def deployment_options(args: argparse.Namespace, settings: ServerConfig, spec: DeploymentSpec
                       ) -> dict[str, Any]:
    """Serve's deployment options for these flags (``ValueError`` for a capping max_ongoing_requests)."""
    max_ongoing, warning = check_max_ongoing(args.max_ongoing_requests, driver_configs(settings, spec))
    if warning:
        log.warning("ray: %s", warning)
    options: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "ray_actor_options": {"num_cpus": args.replica_cpus},
        "logging_config": {"enable_access_log": bool(args.access_log)},  # Serve's, per request
    }
    bounds = parse_autoscale(args.autoscale)
    if bounds is None:
        if args.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
        options["num_replicas"] = args.replicas
    else:
        from batchpilot.server.ray.autoscale import autoscaling_config

        options["autoscaling_config"] = autoscaling_config(
            bounds[0], bounds[1], args.target_queue_wait_ms / 1000.0, args.upscale_delay_s,
            args.downscale_delay_s)
    return options


def bind_app(args: argparse.Namespace, settings: ServerConfig, spec: DeploymentSpec) -> Any:
    """The bound Serve application (``serve.run`` / an app builder's answer)."""
    from ray import serve

    from batchpilot.server.ray.replica import BatchpilotReplica

    options = deployment_options(args, settings, spec)
    deployment = serve.deployment(BatchpilotReplica, name="BatchpilotReplica").options(**options)
    log.info("ray: deployment %s", {k: v for k, v in options.items() if k not in ("autoscaling_config",
                                                                                      "logging_config")}
             | ({"autoscale": args.autoscale} if args.autoscale else {}))
    from batchpilot.settings import rollout_from_args

    return deployment.bind(settings, spec, options["max_ongoing_requests"], rollout_from_args(args, spec))


def parse_serve_flags(flags: Sequence[str]) -> argparse.Namespace:
    """``batchpilot serve`` flags, parsed by the same parser (``server.cli.register``)."""
    from batchpilot.server.cli import register

    parser = argparse.ArgumentParser(prog="batchpilot-serve")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *flags])


def app_builder(args: Mapping[str, str]) -> Any:
    """For ``serve run batchpilot.server.ray.app:app_builder flags="..."`` and ``serve deploy``
    (``args: {flags: "..."}`` in the config file): the flags are ``batchpilot serve``'s. The Ray
    cluster and its ingress are the caller's (``RAY_SERVE_ENABLE_HA_PROXY=1`` for HAProxy)."""
    from batchpilot.server import logs
    from batchpilot.server.cli import server_config
    from batchpilot.settings import spec_from_args

    unknown = set(args) - {"flags"}
    if unknown:
        raise ValueError(f"batchpilot app_builder: unknown argument(s) {sorted(unknown)}; pass "
                         f"flags=\"<batchpilot serve flags>\"")
    parsed = parse_serve_flags(shlex.split(args.get("flags", "")))
    logs.configure(parsed.log_level, parsed.log_format)
    spec = spec_from_args(parsed)
    return bind_app(parsed, server_config(parsed, spec), spec)


def run_ray(args: argparse.Namespace) -> int:
    """Start Ray and Serve on ``--host``/``--port``, deploy, serve until SIGTERM/SIGINT, then delete
    the app (replicas drain) and stop Ray. Exit status 0, or 1 if the drain did not finish in time."""
    from batchpilot.server import logs
    from batchpilot.server.cli import server_config
    from batchpilot.server.ray.cluster import choose_ingress, start_cluster, stop_cluster, unbound_listeners
    from batchpilot.settings import spec_from_args

    logs.configure(args.log_level, args.log_format)
    spec = spec_from_args(args)
    settings = server_config(args, spec)
    try:
        deployment_options(args, settings, spec)  # refuse bad flags before Ray starts
    except ValueError as exc:
        raise SystemExit(f"batchpilot serve --ray: {exc}") from None
    ingress, why = choose_ingress(args.ingress)
    if ingress == args.ingress:
        log.info("ray: ingress %s: %s", ingress, why)
    else:
        log.warning("ray: ingress %s instead of %s: %s", ingress, args.ingress, why)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                    settings.host)
    start_cluster(settings.host, settings.port, ingress, args.ray_num_cpus, args.ray_address,
                  settings.keep_alive_s)
    log.info("ray: listening on every interface whatever --host says: %s", "; ".join(unbound_listeners(
        ingress)))
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    drained = False
    try:
        from ray import serve

        serve.run(bind_app(args, settings, spec), name=APP_NAME, route_prefix="/")
        log.info("ray: serving on http://%s:%d", settings.host, settings.port)
        while not stop.wait(1.0):  # a bounded wait: signals are handled between waits
            pass
        log.info("ray: stopping: replicas drain their requests (at most %.0f s)", settings.drain_timeout_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        drained = stop_cluster(APP_NAME, settings.drain_timeout_s + 10.0)
    return 0 if drained else 1
