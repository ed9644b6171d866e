"""The runner's dense matrices: a packed matrix multiplies as the plain one does, and packing is a
measured decision."""

from __future__ import annotations

import pytest
import torch

from batchpilot.models.llm.dense import Dense, PackingReport, can_pack, packing_pays, plan_packing

needs_pack = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="no oneDNN packed linear here")


@needs_pack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_a_packed_matrix_multiplies_as_the_plain_one(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    plain, packed = Dense(w, b), Dense(w, b, packed=True)
    assert packed.nbytes == w.numel() * w.element_size() and plain.nbytes == 0
    got, want = packed(x), plain(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    # the same products summed in another order: float32 to rounding, bfloat16 to one bf16 step
    tol = 1e-5 if dtype == torch.float32 else 0.02 * float(want.abs().max())
    assert float((got.float() - want.float()).abs().max()) <= tol


@needs_pack
def test_packing_is_decided_by_its_measured_speed() -> None:
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    report = packing_pays(weights, torch.device("cpu"), torch.float32, rows=(1, 8), repeats=1)
    assert report.rows == (1, 8) and len(report.plain_ms) == len(report.packed_ms) == 2
    assert all(t > 0 for t in report.plain_ms + report.packed_ms)
    assert "plain/packed" in report.describe()
    # a margin no measurement can meet: never packed
    assert not packing_pays(weights, torch.device("cpu"), torch.float32, rows=(1,), repeats=1,
                            margin=1.0).packed


def test_packed_when_faster_over_the_row_counts_by_the_margin() -> None:
    rows = (1, 4, 16, 64)
    assert plan_packing(rows, [1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5]).packed
    # slower on one row, faster on many: the geometric mean decides, one representation for every count
    mixed = plan_packing(rows, [1, 1, 1, 1], [2.0, 0.8, 0.8, 0.8])
    assert not mixed.packed and "1.01x the plain time" in mixed.describe()
    assert not plan_packing(rows, [1, 1, 1, 1], [0.97, 0.97, 0.97, 0.97]).packed  # within the margin


def test_no_packing_without_onednn_for_the_device() -> None:
    report = packing_pays([torch.randn(8, 8)], torch.device("meta"), torch.float32)
    assert report == PackingReport(False, reason=report.reason) and "oneDNN" in report.reason
