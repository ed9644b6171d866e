"""The ONNX Runtime backend on the real MiniLM: export once, cached; the same vectors as the torch
executor; int8 under the guard; served through ``models.tasks``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from batchpilot.models.encoder import EncoderConfig, EncoderExecutor  # noqa: E402
from batchpilot.models.onnx_encoder import OnnxEncoderExecutor  # noqa: E402
from batchpilot.models.precision import min_cosine, probe_texts  # noqa: E402
from batchpilot.models.tasks import load_model  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def torch_ex() -> EncoderExecutor:
    return EncoderExecutor(EncoderConfig(device="cpu"))


def test_float32_export_matches_the_torch_executor_padded(cache: Path, torch_ex: EncoderExecutor) -> None:
    ex = OnnxEncoderExecutor(EncoderConfig(device="cpu"), cache)
    assert ex.backend == "onnx" and not ex.supports_padding_free()
    texts = probe_texts(ex.tokenizer)
    ids = ex.tokenize(texts, truncate=True)
    want = torch_ex.encode(ids)
    for padding in ("dynamic", "max"):
        got = ex.encode(ids, padding=padding)
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4, padding
    assert min_cosine(ex.encode(ids), want) > 0.99999


def test_the_export_is_cached_and_reused(cache: Path) -> None:
    first = OnnxEncoderExecutor(EncoderConfig(device="cpu"), cache)
    stamp = first.onnx_path.stat().st_mtime_ns
    again = OnnxEncoderExecutor(EncoderConfig(device="cpu"), cache)
    assert again.onnx_path == first.onnx_path and again.onnx_path.stat().st_mtime_ns == stamp


def test_int8_runs_and_the_auto_choice_keeps_what_passes_the_guard(cache: Path,
                                                                   torch_ex: EncoderExecutor) -> None:
    ex = OnnxEncoderExecutor(EncoderConfig(device="cpu", dtype="int8"), cache)
    texts = probe_texts(ex.tokenizer)
    cos = min_cosine(ex.encode(texts), torch_ex.encode(texts))
    assert 0.5 < cos <= 1.0 + 1e-6
    auto = load_model(None, dtype="auto", backend="onnx", cache_dir=str(cache))
    report = auto.precision
    assert set(report.measured) == {"float32", "int8"} and auto.backend == "onnx"
    assert report.chosen == ("int8" if report.measured["int8"]["min_cosine"] >= 0.999 and
                             report.measured["int8"]["ms"] < report.measured["float32"]["ms"] else "float32")


def test_half_precision_is_refused_on_the_onnx_backend(cache: Path) -> None:
    with pytest.raises(ValueError, match="onnx backend runs float32 or int8"):
        OnnxEncoderExecutor(EncoderConfig(device="cpu", dtype="bfloat16"), cache)
