"""The console script: --help and --version work, and every documented subcommand is listed."""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

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


def test_serve_takes_name_task_and_profile_once_per_model() -> None:
    from batchpilot.cli import build_parser
    from batchpilot.server.cli import model_specs
    from batchpilot.server.config import ModelSpec

    parse = build_parser().parse_args
    assert model_specs(parse(["serve"])) == (ModelSpec(),)
    args = parse(["serve", "--model", "a", "--model", "b", "--model-name", "x", "--model-name", "y",
                  "--task", "embed", "--task", "score"])
    assert model_specs(args) == (ModelSpec("a", "x", "embed"), ModelSpec("b", "y", "score"))
    with pytest.raises(SystemExit, match="--task was given 1 times for 2 model"):
        model_specs(parse(["serve", "--model", "a", "--model", "b", "--task", "score"]))
    with pytest.raises(SystemExit):  # argparse: not a task
        parse(["serve", "--task", "rerank"])


def test_task_detection_and_override_from_the_checkpoint(tmp_path: Path) -> None:
    import json

    from batchpilot.models.tasks import detect_task, resolve_task

    def folder(name: str, **cfg: object) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)

    ce = folder("ce", architectures=["BertForSequenceClassification"], num_labels=1)
    clf = folder("clf", architectures=["BertForSequenceClassification"], id2label={"0": "a", "1": "b"})
    emb = folder("emb", architectures=["BertModel"])
    assert [detect_task(p) for p in (ce, clf, emb, None)] == ["score", "classify", "embed", "embed"]
    assert resolve_task(ce, "classify") == "classify" and resolve_task(clf, "embed") == "embed"
    with pytest.raises(ValueError, match="needs a one-output cross-encoder"):
        resolve_task(clf, "score")
    with pytest.raises(ValueError, match="no classification head"):
        resolve_task(emb, "classify")
    with pytest.raises(ValueError, match="has no config.json"):
        detect_task(str(tmp_path))
