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


def test_llm_engine_flags_override_the_config_files_llm_section(tmp_path: Path) -> None:
    from batchpilot.cli import build_parser
    from batchpilot.core.deployment import resolve_llm_deployment
    from batchpilot.settings import spec_from_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text("llm: {max_num_seqs: 8, policy: priority, block_size: 32}\n")
    parse = build_parser().parse_args
    spec = spec_from_args(parse(["serve", "--llm", "--config", str(cfg), "--max-num-seqs", "16",
                                 "--num-kv-blocks", "512", "--no-enable-chunked-prefill",
                                 "--enable-prefix-caching", "--max-priority-wait-s", "2.5"]))
    llm = spec.llm
    assert (llm.max_num_seqs, llm.num_kv_blocks, llm.block_size, llm.policy) == (16, 512, 32, "priority")
    assert (llm.enable_chunked_prefill, llm.enable_prefix_caching) == (False, True)
    assert llm.max_priority_wait_s == 2.5
    assert resolve_llm_deployment(spec).config.max_num_seqs == 16  # what build_llm_engine runs
    same = spec_from_args(parse(["simulate", "--target", "llm", "--config", str(cfg), "--max-num-seqs", "16",
                                 "--num-kv-blocks", "512", "--no-enable-chunked-prefill",
                                 "--enable-prefix-caching", "--max-priority-wait-s", "2.5"]))
    assert same.llm == llm  # the same flags are the same engine in the simulator
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        spec_from_args(parse(["serve", "--max-num-seqs", "0"]))
