"""The runner's dense matrices, ``y = x @ w.T (+ b)``: plain, or through oneDNN's prepacked weights.

On a CPU, ``x @ w.T`` hands the weight to the BLAS in its stored ``[out, in]`` layout on every call;
in bfloat16 that call goes through oneDNN, which reorders the weight into its blocked layout each time
(a copy of the whole matrix per call). ``torch.ops.mkldnn._reorder_linear_weight`` does that reorder
once, and ``torch.ops.mkldnn._linear_pointwise`` multiplies by the packed weight (AMX or AVX512-BF16
tiles where the CPU has them; the bias added in the same kernel). This is what inductor's CPU freezing
pass does to a frozen ``nn.Linear``; here it is done by hand on the runner's fused matrices.

Packing is not always faster (float32 on one row runs better through MKL's ``sgemv``), so
``packing_pays`` measures it on the model's own matrices at start-up, at several row counts, and the
runner multiplies by the packed copy only at the row counts where it paid (``PackRule``: each measured
count decides for the counts from it up to the next). The packed copy sits beside the plain weight,
which the static fallback (HF ``generate`` on the same tensors) and the plain row counts read: a packed
model holds its dense weights twice, and the memory accounts count both (``Dense.nbytes``).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# the row counts packing is timed at: a lone decode, small and large decode batches, a prefill chunk
PACK_ROWS = (1, 4, 16, 64, 256)
PACK_MARGIN = 0.05  # hold a packed copy only when it is this much faster at one of the counts at least


def can_pack(device: torch.device) -> bool:
    """oneDNN's packed linear exists in this torch build, for a CPU tensor."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


@dataclass(frozen=True)
class PackRule:
    """At which row counts the packed copy multiplies: ``use[i]`` for inputs of ``rows[i]`` rows up to
    ``rows[i + 1]`` (the first also below it, the last above it)."""

    rows: tuple[int, ...] = (1,)
    use: tuple[bool, ...] = (True,)

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.use) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"pack rule: rows {self.rows} must be ascending, one decision each ({self.use})")

    def packed_at(self, n: int) -> bool:
        i = bisect.bisect_right(self.rows, n) - 1
        return self.use[max(i, 0)]

    def describe(self) -> str:
        if all(self.use):
            return "packed"
        spans: list[list[int]] = []  # [first, end) of each run of packed counts; end 0: no end
        for lo, hi, u in zip(self.rows, (*self.rows[1:], 0), self.use, strict=True):
            if u and spans and spans[-1][1] == lo:
                spans[-1][1] = hi
            elif u:
                spans.append([lo, hi])
        return "packed at " + ", ".join(f"{lo}-{hi - 1}" if hi else f"{lo}+" for lo, hi in spans) + " rows"


class Dense:
    """One dense matrix of the runner: ``weight [out, in]``, an optional ``bias [out]`` and, under a
    ``PackRule``, oneDNN's packed copy of the weight that ``__call__`` multiplies by at the rule's row
    counts."""

    __slots__ = ("bias", "packed", "rule", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 rule: PackRule | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.rule = rule
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if rule is not None else None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (the plain weight and bias are the model's, counted with it)."""
        return 0 if self.packed is None else self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rule is not None and self.rule.packed_at(x.shape[0]):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class PackingReport:
    """What ``packing_pays`` measured (milliseconds of every matrix at each row count, plain and packed)
    and the rule it makes of it (None: no packed copy)."""

    rule: PackRule | None
    rows: tuple[int, ...] = ()
    plain_ms: tuple[float, ...] = ()
    packed_ms: tuple[float, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        verdict = "plain" if self.rule is None else self.rule.describe()
        if not self.rows:
            return f"weights {verdict} ({self.reason})"
        pts = ", ".join(f"{r} rows {p:.2f}/{q:.2f} ms" for r, p, q in
                        zip(self.rows, self.plain_ms, self.packed_ms, strict=True))
        return f"weights {verdict} ({self.reason}; plain/packed: {pts})"


def packing_pays(weights: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                 rows: Sequence[int] = PACK_ROWS, repeats: int = 3,
                 margin: float = PACK_MARGIN) -> PackingReport:
    """Time every matrix of ``weights`` (``[out, in]``, already ``dtype`` on ``device``) at each row count,
    plain and packed, round-robin ``repeats`` times (a drift in the machine's speed moves both alike), and
    plan from the medians (``plan_packing``)."""
    if not can_pack(device):
        return PackingReport(None, reason=f"no oneDNN packed linear for {device.type} in this torch")
    plain = [Dense(w) for w in weights]
    packed = [Dense(w, rule=PackRule()) for w in weights]
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = max(int(w.shape[1]) for w in weights)
    source = torch.randn(max(rows), width, generator=gen).to(device, dtype)
    inputs = [[source[:r, : int(w.shape[1])].contiguous() for w in weights] for r in rows]
    times: dict[tuple[int, bool], list[float]] = {(r, p): [] for r in rows for p in (False, True)}
    with torch.inference_mode():
        for xs in inputs:  # warm-up: first calls allocate and pick kernels
            _run(plain, xs)
            _run(packed, xs)
        for _ in range(repeats):
            for r, xs in zip(rows, inputs, strict=True):
                for is_packed, dense in ((False, plain), (True, packed)):
                    t0 = time.perf_counter()
                    _run(dense, xs)
                    times[(r, is_packed)].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return plan_packing(rows, [med[(r, False)] for r in rows], [med[(r, True)] for r in rows], margin)


def plan_packing(rows: Sequence[int], plain_ms: Sequence[float], packed_ms: Sequence[float],
                 margin: float = PACK_MARGIN) -> PackingReport:
    """``packing_pays``'s rule from its medians at ``rows`` (ascending): packed at each count where it was
    faster; no packed copy at all unless it was ``margin`` faster at one count at least."""
    use = tuple(q < p for p, q in zip(plain_ms, packed_ms, strict=True))
    pays = any(q < (1.0 - margin) * p for p, q in zip(plain_ms, packed_ms, strict=True))
    ratio = math.exp(sum(math.log(q / p) for p, q in zip(plain_ms, packed_ms, strict=True)) / len(rows))
    reason = f"packed takes {ratio:.2f}x the plain time, geometric mean over {len(rows)} row counts"
    rule = PackRule(tuple(rows), use) if pays else None
    return PackingReport(rule, tuple(rows), tuple(plain_ms), tuple(packed_ms), reason)


def _run(dense: Sequence[Dense], xs: Sequence[torch.Tensor]) -> None:
    for d, x in zip(dense, xs, strict=True):
        d(x)
