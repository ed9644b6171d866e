"""``batchpilot serve --ray``: the flags of ``add_ray_args`` (how many replicas and how they are routed
to) and the driver (``run_ray``): Ray and Serve started, the app deployed, served until SIGTERM/SIGINT.
The Serve pieces are in ``replica`` (the deployment), ``cluster`` (Ray, the ingress, the listener),
``autoscale`` (the policy) and ``limits`` (``max_ongoing_requests``). Imports Ray only when it runs, so
``batchpilot serve --help`` works without it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.server.config import ServerConfig
from batchpilot.server.ray.limits import check_max_ongoing

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


def run_ray(args: argparse.Namespace, settings: ServerConfig, spec: DeploymentSpec) -> int:
    """Start Ray and Serve on ``--host``/``--port``, deploy, serve until SIGTERM/SIGINT, then delete
    the app (replicas drain) and stop Ray. Exit status 0, or 1 if the drain did not finish in time."""
    from batchpilot.server.ray.cluster import choose_ingress, start_cluster, stop_cluster, unbound_listeners

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
