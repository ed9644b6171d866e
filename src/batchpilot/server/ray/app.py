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

This module is the app builder ``serve run`` and ``serve deploy`` name; the flags and the ``serve --ray``
driver are ``server/ray/cli.py``'s, the deployment ``server/ray/replica.py``'s.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from batchpilot.server import logs
from batchpilot.server.cli import parse_serve_flags, server_config
from batchpilot.server.ray.cli import bind_app
from batchpilot.settings import spec_from_args


def app_builder(args: Mapping[str, str]) -> object:
    """For ``serve run batchpilot.server.ray.app:app_builder flags="..."`` and ``serve deploy``
    (``args: {flags: "..."}`` in the config file): the flags are ``batchpilot serve``'s. The Ray
    cluster and its ingress are the caller's (``RAY_SERVE_ENABLE_HA_PROXY=1`` for HAProxy)."""
    unknown = set(args) - {"flags"}
    if unknown:
        raise ValueError(f"batchpilot app_builder: unknown argument(s) {sorted(unknown)}; pass "
                         f"flags=\"<batchpilot serve flags>\"")
    parsed = parse_serve_flags(shlex.split(args.get("flags", "")))
    logs.configure(parsed.log_level, parsed.log_format)
    spec = spec_from_args(parsed)
    return bind_app(parsed, server_config(parsed, spec), spec)
