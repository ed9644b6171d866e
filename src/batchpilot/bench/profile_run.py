"""``batchpilot profile`` in a subprocess, pinned as the server it predicts will be.

``bench fidelity`` (encoder and LLM), ``bench tuner`` and benchmarks profile the machine before any
measured traffic: ``run_profile`` writes a fresh profile, ``run_recheck`` times the profile's own grid
again right before a load point (``batchpilot profile --recheck``) and returns the machine's speed
against it. Both run with the server's pinning (``serverproc.pinned``), so that the profile sees the
cores the server will have.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from batchpilot.bench.serverproc import pinned


def run_profile(out: Path, padding: str, extra: str = "", cpus: str | None = None,
                name: str = "profile.json") -> Path:
    """``batchpilot profile -o out/name`` in a subprocess, pinned like the server (before any traffic)."""
    path = out / name
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "profile", "--output", str(path),
           "--padding", "none" if padding == "none" else "dynamic", *shlex.split(extra)]
    print("profiling:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return path


def run_recheck(out: Path, profile: Path, cpus: str | None, name: str) -> float:
    """``batchpilot profile --recheck`` in a subprocess pinned like the server: the machine's speed
    against ``profile`` right now (``SpeedCheck.speed``), its rescaled profile written to out/name."""
    path = out / name
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "profile", "--recheck", str(profile),
           "--output", str(path)]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    return float(json.loads(path.read_text())["speed_check"]["ratio"]) - 1.0
