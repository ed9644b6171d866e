"""The command line of the models package: ``python -m batchpilot.models.seeded`` (no ``batchpilot``
subcommand; tests and benchmarks build their offline models with it).

Only the flags live here. ``models.seeded.main`` parses with them and calls its builders: the entry point
has to be the module ``python -m`` runs, and a parser that imported the builders back would make the two
modules import each other.
"""

from __future__ import annotations

import argparse


def seeded_parser() -> argparse.ArgumentParser:
    """``python -m batchpilot.models.seeded {cross-encoder,classifier} OUT [--seed N] [--layers N]
    [--labels a,b,c] [--multi-label]``."""
    parser = argparse.ArgumentParser(prog="python -m batchpilot.models.seeded",
                                     description="Build a seeded random sequence-classification model.")
    parser.add_argument("kind", choices=("cross-encoder", "classifier"))
    parser.add_argument("out", help="folder to write the HF checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="encoder layers (default: MiniLM's 6)")
    parser.add_argument("--labels", default="negative,neutral,positive",
                        help="comma-separated class names (classifier only)")
    parser.add_argument("--multi-label", action="store_true", help="independent sigmoid per label")
    return parser
