"""``batchpilot`` command line. Each subcommand lives with the layer it drives and registers itself.

A module listed in ``SUBCOMMANDS`` exposes ``register(subparsers)`` which adds its parser(s) and sets
``func`` (a callable taking the parsed args, returning an exit code). Imports are lazy so that
``batchpilot --help`` works without torch or fastapi installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from batchpilot import __version__

# module -> subcommands it registers (listed here so --help can name them before importing)
SUBCOMMANDS: dict[str, tuple[str, ...]] = {
    "batchpilot.server.cli": ("serve",),
    "batchpilot.profile.cli": ("profile",),
    "batchpilot.sim.cli": ("simulate", "tune"),
    "batchpilot.bench.cli": ("bench",),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchpilot",
        description="Inference batching that keeps every request inside its latency budget.",
    )
    parser.add_argument("--version", action="version", version=f"batchpilot {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,profile,simulate,tune,bench}")
    for module_name, names in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a missing optional extra: say how to get it
            for name in names:
                p = sub.add_parser(name, help=f"(unavailable: {exc})")
                p.set_defaults(func=_unavailable(name, exc))
            continue
        module.register(sub)
    return parser


def _unavailable(name: str, exc: ImportError):  # type: ignore[no-untyped-def]
    def run(_: argparse.Namespace) -> int:
        print(f"batchpilot {name}: {exc}. Install the extras: pip install 'batchpilot[all]'", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
