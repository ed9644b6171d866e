"""The runner's dense matrices, ``y = x @ w.T (+ b)``: plain, or through oneDNN's prepacked weights.

On a CPU, ``x @ w.T`` hands the weight to the BLAS in its stored ``[out, in]`` layout on every call;
in bfloat16 that call goes through oneDNN, which reorders the weight into its blocked layout each time
(a copy of the whole matrix per call). ``torch.ops.mkldnn._reorder_linear_weight`` does that reorder
once, and ``torch.ops.mkldnn._linear_pointwise`` multiplies by the packed weight (AMX or AVX512-BF16
tiles where the CPU has them; the bias added in the same kernel). This is what inductor's CPU freezing
pass does to a frozen ``nn.Linear``; here it is done by hand on the runner's fused matrices.

The reorder takes a batch-size hint, and the layout it picks for a hint of one row is a poor one: on an
AMD EPYC (AVX512-BF16, one thread) the tiny Llama's 25 float32 matrices took 3.37 ms at one row packed
for one row and 2.53 ms packed with no hint, 4.94 and 2.64 ms at two rows, and the no-hint layout was
faster up to 64 rows; in bfloat16 the two were within noise (``benchmarks/llm_step.py``, its layouts
table). So the weights are packed with no hint, for every row count a step can have.

Packing need not be faster (a BLAS whose matrix x vector is good can beat it on few rows), so
``packing_pays`` measures it on the model's own matrices at start-up, at several row counts, and the
runner packs when it is faster over them (the geometric mean). One representation serves every row
count: using the plain copy for some counts and the packed one for others keeps both in the caches'
working set, which slowed the plain matrix x vector by half on the tiny Llama. For the same reason each
representation is timed in a block of its own.
The packed copy sits beside the plain weight, which the static fallback (HF ``generate`` on the same
tensors) reads: a packed model holds its dense weights twice, and the memory accounts count both
(``Dense.nbytes``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# the row counts packing is timed at: a lone decode, small and large decode batches, a prefill chunk
PACK_ROWS = (1, 4, 16, 64, 256)
PACK_MARGIN = 0.05  # pack only when it is at least this much faster (geometric mean over PACK_ROWS)


def can_pack(device: torch.device) -> bool:
    """oneDNN's packed linear exists in this torch build, for a CPU tensor."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class Dense:
    """One dense matrix of the runner: ``weight [out, in]``, an optional ``bias [out]`` and, when
    ``packed``, oneDNN's packed copy of the weight that ``__call__`` multiplies by."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False) -> None:
        self.weight = weight
        self.bias = bias
        # no batch-size hint: the layout oneDNN picks for any row count (module docstring)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if packed else None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (the plain weight and bias are the model's, counted with it)."""
        return 0 if self.packed is None else self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class PackingReport:
    """What ``packing_pays`` measured (milliseconds of every matrix at each row count, plain and packed)
    and decided."""

    packed: bool
    rows: tuple[int, ...] = ()
    plain_ms: tuple[float, ...] = ()
    packed_ms: tuple[float, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        verdict = "packed" if self.packed else "plain"
        if not self.rows:
            return f"weights {verdict} ({self.reason})"
        pts = ", ".join(f"{r} rows {p:.2f}/{q:.2f} ms" for r, p, q in
                        zip(self.rows, self.plain_ms, self.packed_ms, strict=True))
        return f"weights {verdict} ({self.reason}; plain/packed: {pts})"


def packing_pays(weights: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                 rows: Sequence[int] = PACK_ROWS, repeats: int = 3,
                 margin: float = PACK_MARGIN) -> PackingReport:
    """Time every matrix of ``weights`` (``[out, in]``, already ``dtype`` on ``device``) at each row count,
    plain in one block and packed in another (each block touches one copy, as serving does), the blocks
    taking turns ``repeats`` times so that a drift in the machine's speed moves both alike; packed when
    the geometric mean of packed/plain over the row counts is under ``1 - margin``."""
    if not can_pack(device):
        return PackingReport(False, reason=f"no oneDNN packed linear for {device.type} in this torch")
    kinds = {False: [Dense(w) for w in weights], True: [Dense(w, packed=True) for w in weights]}
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = max(int(w.shape[1]) for w in weights)
    source = torch.randn(max(rows), width, generator=gen).to(device, dtype)
    inputs = [[source[:r, : int(w.shape[1])].contiguous() for w in weights] for r in rows]
    times: dict[tuple[int, bool], list[float]] = {(r, p): [] for r in rows for p in (False, True)}
    with torch.inference_mode():
        for dense in kinds.values():  # warm-up: first calls allocate and pick kernels
            for xs in inputs:
                _run(dense, xs)
        for _ in range(repeats):
            for is_packed, dense in kinds.items():
                _run(dense, inputs[0])  # untimed: this copy back in the caches the other block used
                for r, xs in zip(rows, inputs, strict=True):
                    t0 = time.perf_counter()
                    _run(dense, xs)
                    times[(r, is_packed)].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return plan_packing(rows, [med[(r, False)] for r in rows], [med[(r, True)] for r in rows], margin)


def plan_packing(rows: Sequence[int], plain_ms: Sequence[float], packed_ms: Sequence[float],
                 margin: float = PACK_MARGIN) -> PackingReport:
    """``packing_pays``'s decision from its medians at ``rows``."""
    ratio = math.exp(sum(math.log(q / p) for p, q in zip(plain_ms, packed_ms, strict=True)) / len(rows))
    reason = f"packed takes {ratio:.2f}x the plain time, geometric mean over {len(rows)} row counts"
    return PackingReport(ratio < 1.0 - margin, tuple(rows), tuple(plain_ms), tuple(packed_ms), reason)


def _run(dense: Sequence[Dense], xs: Sequence[torch.Tensor]) -> None:
    for d, x in zip(dense, xs, strict=True):
        d(x)
