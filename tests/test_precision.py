"""The precision choice on the real MiniLM: candidates from the CPU's features, the accuracy guard,
int8, and the ``model:`` section of the config file. Nothing here asserts a speed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchpilot.core.deployment import DeploymentSpec, ModelOptions
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor
from batchpilot.models.precision import candidates, choose_precision, min_cosine, probe_texts
from batchpilot.settings import load_spec

CPU = torch.device("cpu")
BF16 = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def load(dtype: str) -> EncoderExecutor:
    return EncoderExecutor(EncoderConfig(device="cpu", dtype=dtype))  # type: ignore[arg-type]


def test_candidates_follow_the_cpus_bf16_units() -> None:
    assert candidates(CPU) == (["float32", "bfloat16"] if BF16 else ["float32"])


def test_float32_is_served_without_a_probe() -> None:
    ex, report = choose_precision(load, "float32", CPU)
    assert ex.config.dtype == "float32" and report.chosen == "float32" and report.measured == {}


def test_auto_takes_a_candidate_that_passed_the_guard() -> None:
    ex, report = choose_precision(load, "auto", CPU)
    assert ex.config.dtype == report.chosen
    assert set(report.measured) == set(candidates(CPU)) or report.measured == {}
    assert report.min_cosine >= report.threshold
    for dtype, m in report.measured.items():
        if m.get("passed", 1.0):
            assert np.isfinite(m["ms"]) and m["min_cosine"] >= 0.999, dtype
    # what the guard measured is what a reference computation finds
    if report.chosen != "float32":
        texts = probe_texts(ex.tokenizer)
        ref = load("float32").encode(texts)
        assert abs(min_cosine(ex.encode(texts), ref) - report.measured[report.chosen]["min_cosine"]) < 1e-3


def test_int8_quantises_the_linear_layers_and_reports_its_guard() -> None:
    ex = load("int8")
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    assert any(isinstance(m, Int8Linear) for m in ex.model.modules()) and ex.forward_impl == "hf"
    assert not ex.supports_padding_free()
    texts = probe_texts(ex.tokenizer)
    cos = min_cosine(ex.encode(texts), load("float32").encode(texts))
    assert 0.5 < cos < 1.0  # dynamic int8 on MiniLM: close to float32, not within the default guard
    _, report = choose_precision(load, "int8", CPU, threshold=cos - 0.01)  # a guard it can pass
    assert report.chosen == "int8" and abs(report.min_cosine - cos) < 1e-3
    with pytest.raises(ValueError, match="below the guard"):
        choose_precision(load, "int8", CPU, threshold=min(cos + 0.01, 1.0))


@pytest.mark.skipif(not BF16, reason="no bf16 matrix units on this CPU")
def test_bfloat16_runs_padded_and_padding_free_within_the_guard() -> None:
    ex, report = choose_precision(load, "bfloat16", CPU)
    assert report.chosen == "bfloat16" and ex.supports_padding_free()
    texts = probe_texts(ex.tokenizer)
    ref = load("float32").encode(texts)
    for padding in ("dynamic", "none"):
        assert min_cosine(ex.encode(ex.tokenize(texts), padding=padding), ref) >= 0.999


def test_the_model_section_of_the_config_file(tmp_path: object) -> None:
    from pathlib import Path

    cfg = Path(str(tmp_path)) / "c.yaml"
    cfg.write_text("model: {dtype: bfloat16, min_cosine: 0.995}\n")
    assert load_spec(cfg).model == ModelOptions("bfloat16", 0.995)
    assert DeploymentSpec.from_dict(DeploymentSpec().to_dict()).model == ModelOptions()
    for bad, match in (("model: {dtype: int4}", "model.dtype"), ("model: {min_cosine: 1.5}", "min_cosine"),
                       ("model: {dtyp: int8}", "dtyp")):
        cfg.write_text(bad + "\n")
        with pytest.raises(ValueError, match=match):
            load_spec(cfg)
