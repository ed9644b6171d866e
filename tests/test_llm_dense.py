"""The runner's dense matrices: a packed matrix multiplies as the plain one does, and packing is a
measured decision."""

from __future__ import annotations

import pytest
import torch

from batchpilot.models.llm.dense import Dense, PackingReport, PackRule, can_pack, packing_pays, plan_packing

needs_pack = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="no oneDNN packed linear here")


@needs_pack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_a_packed_matrix_multiplies_as_the_plain_one(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    plain, packed = Dense(w, b), Dense(w, b, PackRule())
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
    # a margin no measurement can meet: no packed copy
    assert packing_pays(weights, torch.device("cpu"), torch.float32, rows=(1,), repeats=1,
                        margin=1.0).rule is None


def test_packed_at_the_row_counts_where_it_was_faster() -> None:
    rows = (1, 4, 16, 64)
    assert plan_packing(rows, [1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5]).rule == PackRule(rows, (True,) * 4)
    assert PackRule(rows, (False, True, True, True)).describe() == "packed at 4+ rows"
    mixed = plan_packing(rows, [1, 1, 1, 1], [1.6, 0.9, 1.2, 0.9]).rule  # slower at 1 and 16
    assert mixed is not None and "packed at 4-15, 64+ rows" in mixed.describe()
    assert [mixed.packed_at(n) for n in (1, 3, 4, 15, 16, 63, 64, 500)] == [False, False, True, True, False,
                                                                           False, True, True]
    # never faster by the margin: no packed copy held at all, even where it was a little faster
    assert plan_packing(rows, [1, 1, 1, 1], [0.99, 0.98, 1.2, 1.1]).rule is None
    with pytest.raises(ValueError, match="ascending"):
        PackRule((4, 1), (True, False))


@needs_pack
def test_a_matrix_packed_at_some_rows_multiplies_plainly_at_the_others() -> None:
    w, x1, x8 = torch.randn(16, 8), torch.randn(1, 8), torch.randn(8, 8)
    d = Dense(w, rule=PackRule((1, 4), (False, True)))
    assert torch.equal(d(x1), x1 @ w.T)  # a plain row count: the plain product, bit for bit
    assert torch.allclose(d(x8), x8 @ w.T, atol=1e-5)


def test_no_packing_without_onednn_for_the_device() -> None:
    report = packing_pays([torch.randn(8, 8)], torch.device("meta"), torch.float32)
    assert report == PackingReport(None, reason=report.reason) and "oneDNN" in report.reason
