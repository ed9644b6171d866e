"""The precision an encoder runs at, chosen on this machine by measurement under an accuracy guard.

    choose_precision(load, requested, device, min_cosine) -> (executor, PrecisionReport)

``load(dtype)`` builds the executor at one precision (``EncoderConfig.dtype``). The candidates:

    float32     always (the reference)
    bfloat16    CPU with AVX512-BF16 or AMX (``torch.cpu``'s feature checks); CUDA with bf16 support
    float16     CUDA
    int8        dynamic int8 linear layers (torch's quantised kernels; VNNI/AMX where present); CPU
                only, never chosen by ``auto`` on torch: asked for by name
    onnx        float32 and int8 (ONNX Runtime's dynamic quantisation), both tried by ``auto``

``auto`` measures every candidate the hardware supports on a short probe (three batch shapes, the
median of three runs each after a warm-up) and keeps the fastest that passes the guard. A named
precision is checked by the guard too, and one that fails it is an error (the caller asked for it;
nothing else is served silently in its place).

**The guard.** A fixed probe set of real English texts of mixed lengths (8 to 512 tokens,
``models.texts``) is embedded by the fp32 executor and by the candidate, with every padding mode the
executor supports ("dynamic" and, where it runs, "none"); the candidate passes if the minimum cosine
similarity of its embeddings to fp32's is at least ``min_cosine`` (default 0.999). The report keeps
what was measured (ms on the probe shapes, min cosine) for the log and ``/metrics``.
"""

from __future__ import annotations

import gc
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from batchpilot.core.deployment import PRECISIONS, ModelOptions

log = logging.getLogger("batchpilot.models")

DTYPE_CHOICES = PRECISIONS
DEFAULT_MIN_COSINE = ModelOptions.min_cosine
PROBE_LENGTHS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 200, 256, 320, 400, 512, 20, 40, 80, 140, 300)
PROBE_SHAPES = ((1, 32), (8, 128), (32, 128))  # (batch, tokens): a lone query, a mid and a big batch


@dataclass
class PrecisionReport:
    """What ``choose_precision`` measured and chose."""

    requested: str
    chosen: str
    min_cosine: float  # of the chosen precision vs fp32 (1.0 for fp32 itself)
    threshold: float
    measured: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> {ms, min_cosine}
    reason: str = ""

    def describe(self) -> str:
        rows = ", ".join(f"{d}: " + (f"{m['ms']:.1f} ms, " if np.isfinite(m["ms"]) else "")
                         + f"min cosine {m['min_cosine']:.5f}"
                         + ("" if m.get("passed", 1.0) else " (failed the guard)")
                         for d, m in self.measured.items())
        return f"dtype {self.chosen} ({self.reason}); measured {rows or 'nothing'}"


def candidates(device: torch.device, backend: str = "torch") -> list[str]:
    """The precisions ``auto`` tries on ``device`` with ``backend``, fp32 first (onnx: float32 and
    ONNX Runtime's dynamic int8)."""
    if backend == "onnx":
        return ["float32", "int8"]
    if device.type == "cuda":
        out = ["float32", "float16"]
        if torch.cuda.is_bf16_supported():
            out.insert(1, "bfloat16")
        return out
    cpu = getattr(torch, "cpu", None)
    bf16 = any(bool(getattr(cpu, name, lambda: False)())
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return ["float32", "bfloat16"] if bf16 else ["float32"]


def probe_texts(tokenizer: Any) -> list[str]:
    from batchpilot.models.texts import texts_for_lengths

    return texts_for_lengths(tokenizer, list(PROBE_LENGTHS), seed=7)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return float((a * b).sum(axis=1).min())


def _paddings(executor: Any) -> list[str]:
    return ["dynamic"] + (["none"] if executor.supports_padding_free() else [])


def _embed(executor: Any, texts: list[str]) -> dict[str, np.ndarray]:
    ids = executor.tokenize(texts, truncate=True)
    return {p: executor.encode(ids, padding=p) for p in _paddings(executor)}


def probe_ms(executor: Any, repeats: int = 3) -> float:
    """Milliseconds for the probe shapes, the median of ``repeats`` runs each after a warm-up."""
    from batchpilot.models.profiler import measure

    rng = random.Random(0)
    total = 0.0
    for n, length in PROBE_SHAPES:
        length = min(length, executor.max_length)
        total += measure(executor, [length] * n, "dynamic", repeats, rng, memory=False).latency_s
    return total * 1e3


def choose_precision(load: Callable[[str], Any], requested: str, device: torch.device,
                     threshold: float = DEFAULT_MIN_COSINE,
                     backend: str = "torch") -> tuple[Any, PrecisionReport]:
    """The executor at the precision to serve, and what was measured (see the module docstring)."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype = {requested!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"min_cosine must be in (0, 1], got {threshold}")
    if requested == "float32":
        return load("float32"), PrecisionReport("float32", "float32", 1.0, threshold,
                                                reason="asked for; the reference, no guard")
    tried = candidates(device, backend) if requested == "auto" else ["float32", requested]
    if requested == "auto" and tried == ["float32"]:
        return load("float32"), PrecisionReport(
            "auto", "float32", 1.0, threshold,
            reason=f"no faster precision on this {device.type} (no bf16 matrix units)")
    reference = load("float32")
    texts = probe_texts(reference.tokenizer)
    ref = _embed(reference, texts)
    report = PrecisionReport(requested, "float32", 1.0, threshold)
    timed = requested == "auto"
    report.measured["float32"] = {"ms": probe_ms(reference) if timed else float("nan"), "min_cosine": 1.0}
    best, best_ms = reference, report.measured["float32"]["ms"]
    for dtype in tried[1:]:
        cand = load(dtype)
        got = _embed(cand, texts)
        cos = min(min_cosine(got[p], ref[p]) for p in got)
        passed = cos >= threshold
        ms = probe_ms(cand) if timed and passed else float("nan")
        report.measured[dtype] = {"ms": ms, "min_cosine": cos, "passed": float(passed)}
        if not passed:
            if not timed:
                raise ValueError(f"dtype {dtype}: minimum cosine {cos:.5f} to float32 on the probe set is "
                                 f"below the guard's {threshold}; serve float32, or lower --min-cosine")
            del cand
            continue
        if not timed or ms < best_ms:
            if best is not reference:
                del best
            best, best_ms, report.chosen, report.min_cosine = cand, ms, dtype, cos
        else:
            del cand
    if best is not reference:
        del reference
    gc.collect()
    report.reason = ("the fastest that passed the guard" if timed
                     else f"asked for; passed the guard ({report.min_cosine:.5f} >= {threshold})")
    return best, report
