"""``batchpilot serve``: load the model, pick the cost model, build the app, run uvicorn.

    batchpilot serve                                   # embedded all-MiniLM-L6-v2 on 127.0.0.1:8000
    batchpilot serve --model PATH --config tuned.yaml --profile profile.json --port 8080
    batchpilot serve --model EMBEDDER --model RERANKER # two models, each with its own scheduler
    batchpilot serve --noop                            # a model that costs nothing (serving-path benchmarks)

Each ``--model`` is served with its own scheduler, slots and metrics (label ``model``); its task
(embed, score, classify) is read from the checkpoint (``models.tasks``) unless ``--task`` says.
``--model-name``, ``--task`` and ``--profile`` are given once per ``--model``, in the same order (a
single ``--task`` or ``--profile`` with several models is refused: say it for each).

Cost model of each model, in order: its ``--profile`` (``CostModel.load``); else a brief bounded
start-up profile of the loaded model (``models.profiler.profile_encoder``) unless
``--no-startup-profile``; else the stated default ``CostModel.default_cpu_minilm()``. The log says
which was used. The API key may also come from ``$BATCHPILOT_API_KEY`` (keeps it out of the process
list).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from batchpilot.core.deployment import LLM_PRECISIONS, DeploymentSpec
from batchpilot.server.build import build_app
from batchpilot.server.config import REQUEST_LIMITS, TASKS, ModelSpec, ServerConfig
from batchpilot.server.llm.schemas import CAP, LLMLimits
from batchpilot.server.ray.cli import add_ray_args, run_ray
from batchpilot.server.tenants import Tenancy
from batchpilot.settings import (
    add_deployment_args,
    add_field_flags,
    add_llm_args,
    add_precision_args,
    add_rollout_args,
    rollout_from_args,
    spec_from_args,
)

log = logging.getLogger("batchpilot.server")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model behind the batching layer (OpenAI-compatible)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_deployment_args(p)
    add_precision_args(p)
    add_rollout_args(p)
    add_llm_args(p)
    add_llm_limit_args(p)
    add_startup_args(p)
    add_listener_args(p)
    add_request_limit_args(p)
    add_serving_args(p)
    add_failover_args(p)
    add_log_args(p)
    add_ray_args(p)
    p.set_defaults(func=run)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """What to serve: each ``--model`` with its name and task, its length and threads."""
    p.add_argument("--model", action="append", default=None, metavar="PATH",
                   help="local HF model folder (default: the embedded MiniLM); repeat to serve several")
    p.add_argument("--model-name", action="append", default=None, metavar="NAME",
                   help="name clients use, one per --model (default: the folder's name)")
    p.add_argument("--task", action="append", default=None, choices=TASKS,
                   help="what a --model serves, one per --model (default auto: from its config)")
    p.add_argument("--max-length", type=int, default=None, help="max tokens per input (default: model limit)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, fixed (default: per batch, as the profile's or a start-up "
                   "measurement's thread plan says; models/encoder.py)")


def add_startup_args(p: argparse.ArgumentParser) -> None:
    """Each model's cost model: its profile, else a start-up measurement (or the default)."""
    p.add_argument("--profile", action="append", default=None, metavar="PATH",
                   help="cost-model profile JSON (`batchpilot profile -o`), one per --model")
    p.add_argument("--no-startup-profile", action="store_true",
                   help="without --profile, use the built-in default cost model instead of measuring")


def add_listener_args(p: argparse.ArgumentParser) -> None:
    """Where to listen, the API key, the shutdown drain."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("BATCHPILOT_API_KEY"),
                   help="require Authorization: Bearer KEY on every route but /health (one tenant)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="a YAML keys file: each key names its tenant, each tenant its weight and quotas; "
                        "unknown keys get 401; SIGHUP reloads it (docs/tenants.md)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0)


def add_request_limit_args(p: argparse.ArgumentParser) -> None:
    """The request guards of ``server/middleware.py`` and the embeddings routes."""
    limits = p.add_argument_group("request limits (docs/reliability.md)")
    add_field_flags(limits, ServerConfig, REQUEST_LIMITS)


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """The no-op model, warm-up, the LLM routes and the fidelity logs."""
    p.add_argument("--noop", action="store_true", help="serve a no-op model (benchmarks of the serving path)")
    p.add_argument("--noop-delay-ms", type=float, default=0.0, help="--noop: fixed time per batch")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--llm", action="store_true", help="also mount the LLM completion routes")
    p.add_argument("--llm-model", default=None, help="--llm: local HF causal-LM folder")
    p.add_argument("--llm-dtype", choices=LLM_PRECISIONS, default="auto",
                   help="--llm: precision of the weights and activations (default auto: the fastest this "
                        "machine runs that passes the guard against float32, measured at start-up; a "
                        "--llm-profile's precision when given one)")
    p.add_argument("--llm-kv-dtype", choices=LLM_PRECISIONS[1:], default=None,
                   help="--llm: precision of the KV cache (default: the weights')")
    p.add_argument("--llm-profile", default=None, metavar="PATH",
                   help="--llm: the `batchpilot profile --llm` file the KV pool is planned from (its "
                        "measured memory); without it a memory budget is measured at start-up")
    p.add_argument("--batch-log", default=None, metavar="PATH",
                   help="append one JSON line per executed encoder batch (start, slot seconds, size, "
                        "cost-model features) to PATH: how `bench fidelity` reports the run's speed "
                        "against the profile")
    p.add_argument("--llm-step-log", default=None, metavar="PATH",
                   help="--llm: append one JSON line per engine step (shape features, wall and forward "
                        "seconds) to PATH")


def add_failover_args(p: argparse.ArgumentParser) -> None:
    """The encoder's fallback and both watchdogs."""
    failover = p.add_argument_group("fallback and watchdog (docs/reliability.md)")
    failover.add_argument("--no-encoder-fallback", action="store_true",
                          help="an embedding model served padding-free or below float32 gets no padded "
                               "float32 copy to fall back to when that path fails repeatedly (saves its "
                               "memory)")
    failover.add_argument("--encoder-stall-timeout-s", type=float, default=None, metavar="S",
                          help="an encoder batch running longer than S makes /health 503 until it ends "
                               "(default: measured, 10x the p99 batch time, at least 5 s)")
    failover.add_argument("--llm-fallback", choices=("static", "off"), default="static",
                          help="--llm: what serves while the engine is failed (died, stalled, out of "
                               "memory): static = HF generate in static batches on the same weights "
                               "(default); off = 503 engine_unavailable")
    failover.add_argument("--llm-stall-timeout-s", type=float, default=None, metavar="S",
                          help="--llm: a step running longer than S counts as stalled (default: measured, "
                               "10x the p99 step time, at least 5 s)")


def add_log_args(p: argparse.ArgumentParser) -> None:
    """Log level and format, the access log."""
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"),
                   help="json: one JSON object per line (time, level, logger, message, exc_info)")
    p.add_argument("--access-log", action="store_true", help="log every request (off: it costs throughput)")


def run(args: argparse.Namespace) -> int:
    from batchpilot.server import lifecycle, logs

    logs.configure(args.log_level, args.log_format)
    if getattr(args, "ray", False):  # the same app, as a Ray Serve deployment (server/ray/cli.py)
        spec = spec_from_args(args)
        return run_ray(args, server_config(args, spec), spec)
    from batchpilot.core.llm.config import KVPlanError

    try:  # a setting that cannot work: its message says what to change, no traceback
        spec = spec_from_args(args)
        settings = server_config(args, spec)
        tenancy = Tenancy.of(settings.api_keys, settings.api_key)
    except (ValueError, FileNotFoundError) as exc:  # validation of the file and the flags
        print(f"batchpilot serve: {exc}", file=sys.stderr)
        return 2
    try:
        app = build_app(settings, spec, rollout_from_args(args, spec), tenancy)
    except KVPlanError as exc:  # the LLM's memory plan (core/llm/config.py)
        print(f"batchpilot serve: {exc}", file=sys.stderr)
        return 2
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not tenancy.requires_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                    settings.host)
    # SIGTERM: 503 to new requests while in-flight work drains, then exit 0 (lifecycle.py)
    return lifecycle.serve(app, host=settings.host, port=settings.port,
                           drain_timeout_s=settings.drain_timeout_s, log_level=settings.log_level,
                           access_log=args.access_log, log_format=args.log_format,
                           header_timeout_s=settings.header_timeout_s, keep_alive_s=settings.keep_alive_s)


def server_config(args: argparse.Namespace, spec: DeploymentSpec) -> ServerConfig:
    """The server settings the parsed `serve` flags ask for (shared by `serve` and `serve --ray`)."""
    return ServerConfig(
        host=args.host, port=args.port, models=model_specs(args),
        max_length=args.max_length, num_threads=args.threads,
        serving=spec.server,
        noop=args.noop, noop_delay_s=args.noop_delay_ms / 1000.0,
        startup_profile=not args.no_startup_profile, api_key=args.api_key,
        api_keys=getattr(args, "api_keys", None),
        **{name: getattr(args, name) for name in REQUEST_LIMITS},
        drain_timeout_s=args.drain_timeout_s, warmup=not args.no_warmup, llm=args.llm,
        llm_model=args.llm_model, llm_profile=args.llm_profile, llm_limits=llm_limits_from_args(args),
        llm_dtype=args.llm_dtype, llm_kv_dtype=args.llm_kv_dtype,
        llm_step_log=args.llm_step_log,
        batch_log=args.batch_log,
        llm_fallback=args.llm_fallback, llm_stall_timeout_s=args.llm_stall_timeout_s,
        encoder_fallback=not args.no_encoder_fallback, encoder_stall_timeout_s=args.encoder_stall_timeout_s,
        log_level=args.log_level)


def model_specs(args: argparse.Namespace) -> tuple[ModelSpec, ...]:
    """One ``ModelSpec`` per ``--model`` (or the embedded model), with its name, task and profile."""
    paths: list[str | None] = list(args.model or [None])
    per_model = {"--model-name": args.model_name, "--task": args.task, "--profile": args.profile}
    for flag, values in per_model.items():
        if values is not None and len(values) != len(paths):
            raise SystemExit(f"batchpilot serve: {flag} was given {len(values)} times for {len(paths)} "
                             f"model(s); give it once per --model, in the same order")
    return tuple(ModelSpec(path=path, name=(args.model_name or [None] * len(paths))[i],
                           task=(args.task or ["auto"] * len(paths))[i],
                           profile=(args.profile or [None] * len(paths))[i])
                 for i, path in enumerate(paths))


def parse_serve_flags(flags: Sequence[str]) -> argparse.Namespace:
    """``batchpilot serve`` flags, parsed by the same parser (``register``)."""
    parser = argparse.ArgumentParser(prog="batchpilot-serve")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *flags])


def main(argv: list[str] | None = None) -> int:
    """``python -m batchpilot.server.cli [serve options]``: serve, without the other subcommands."""
    parser = argparse.ArgumentParser(prog="batchpilot-serve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())


# ``serve``'s flags for the LLM request-size limits (``server.llm.schemas.LLMLimits``), named like the
# encoder's ``--max-inputs`` / ``--max-input-chars`` with the ``--llm-`` prefix of the other LLM flags:
#
#     --llm-max-prompts N          prompts per completion request                      (default 64)
#     --llm-max-prompt-chars N     characters per prompt, and per conversation         (default 1048576)
#     --llm-max-messages N         messages per chat request                           (default 512)
#     --llm-max-stop N             stop sequences per request                          (default 4)
#     --llm-max-stop-chars N       characters per stop sequence                        (default 256)
#     --llm-max-stop-token-ids N   stop_token_ids per request                          (default 64)
#
# Like the encoder's limits they are flags of ``serve`` (``ServerConfig.llm_limits``), not keys of the
# config file's ``server:`` section. Each is a whole number >= 1. The four that count list items are also
# at most ``server.llm.schemas.CAP`` (4096), the schema's bound on any list in a request body: a longer
# list is
# refused by validation (422) before any limit is looked at, so a limit above it could never apply. A
# value outside these bounds stops ``serve`` with a usage error naming the flag and what it accepts.

# LLMLimits field -> (what it bounds, the most a flag may ask for: None when only >= 1)
LIMITS: dict[str, tuple[str, int | None]] = {
    "max_prompts": ("prompts per completion request", CAP),
    "max_prompt_chars": ("characters per prompt, and per conversation (all its messages' text)", None),
    "max_messages": ("messages per chat request", CAP),
    "max_stop": ("stop sequences per request", CAP),
    "max_stop_chars": ("characters per stop sequence", None),
    "max_stop_token_ids": ("stop_token_ids per request", CAP),
}
assert set(LIMITS) == {f.name for f in fields(LLMLimits)}, "every LLM limit has its flag"


def flag(name: str) -> str:
    """The flag of an ``LLMLimits`` field: ``max_prompts`` -> ``--llm-max-prompts``."""
    return "--llm-" + name.replace("_", "-")


def _bounded(cap: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        if cap is not None and value > cap:
            raise argparse.ArgumentTypeError(
                f"must be at most {cap}, got {value}: a request body's lists are capped at {cap} items "
                f"(longer ones are refused by validation first), so a higher limit never applies")
        return value

    return parse


def add_llm_limit_args(p: argparse.ArgumentParser) -> None:
    """The six limit flags, in their own group of ``serve --help``."""
    g = p.add_argument_group("LLM request limits (--llm; a 400 naming the field; docs/reliability.md)")
    for name, (what, cap) in LIMITS.items():
        g.add_argument(flag(name), dest="llm_" + name, type=_bounded(cap), default=getattr(LLMLimits, name),
                       metavar="N", help=f"{what} (default: %(default)s)")


def llm_limits_from_args(args: argparse.Namespace) -> LLMLimits:
    """The ``LLMLimits`` the parsed flags ask for (the defaults where a namespace lacks them)."""
    return LLMLimits(**{name: getattr(args, "llm_" + name, getattr(LLMLimits, name)) for name in LIMITS})
