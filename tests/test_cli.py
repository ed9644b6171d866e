"""The console script: --help and --version work, and every documented subcommand is listed."""

import argparse
import importlib
import subprocess
import sys

import pytest

from batchpilot import __version__
from batchpilot.cli import SUBCOMMANDS


def test_version_and_help_from_the_installed_script() -> None:
    cmd = [sys.executable, "-m", "batchpilot.cli"]
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.strip() == f"batchpilot {__version__}"
    helped = subprocess.run([*cmd, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0
    for name in ("serve", "profile", "simulate", "tune", "bench"):
        assert name in helped.stdout


@pytest.mark.parametrize("module_name", sorted(SUBCOMMANDS))
def test_every_subcommand_module_imports_and_registers(module_name: str) -> None:
    # build_parser() hides an ImportError behind an "unavailable" stub; with all extras installed
    # (as in the test environment) every module must import and register its subcommands for real.
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    module.register(sub)
    assert set(SUBCOMMANDS[module_name]) <= set(sub.choices)
