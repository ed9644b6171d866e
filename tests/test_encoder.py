"""Encoder executor against sentence-transformers, with the real MiniLM, in every padding mode.

Parity means: each embedding equals ``SentenceTransformer(path).encode(text, normalize_embeddings=True)``
(encoded alone, so no padding at all) with cosine >= 0.99999, whatever shares its batch. Models load once
per module; batches stay small so the file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling as STPooling

from batchpilot.core.admission import pad_length
from batchpilot.core.batch import Batch
from batchpilot.core.costmodel import BatchShape
from batchpilot.core.request import Request
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, default_model_path, make_batch
from batchpilot.models.pooling import POOLING_MODES, PoolingConfig, pool
from batchpilot.models.st_modules import STModules

COS_MIN = 0.99999
_WORDS = " ".join(topics[k] for k in sorted(topics)).split()
# token lengths 4, 31, 49, 157, 349, 436: short, medium, past ST's 256 cap, near 512
TEXTS = ["Hi!"] + [" ".join(_WORDS[i * 700 : i * 700 + n]) for i, n in enumerate((6, 30, 100, 160, 240))]


@pytest.fixture(scope="module")
def ex() -> EncoderExecutor:
    return EncoderExecutor(EncoderConfig(device="cpu"))


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    st = SentenceTransformer(default_model_path(), device="cpu")
    st.max_seq_length = 512  # serve past ST's 256 default: compare at the same limit
    return np.stack([st.encode(t, normalize_embeddings=True) for t in TEXTS])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def batch_of(ids: list[list[int]], padding: str, padded_len: int) -> Batch:
    reqs = [Request(id=i, arrival=0.0, length=len(x), payload=x) for i, x in enumerate(ids)]
    shape = BatchShape.padded([len(x) for x in ids], padded_len)
    return Batch(7, reqs, padded_len, shape, padding, 0.0)


# every text in a mixed-length batch (short next to long), in two batches; dynamic also runs all six
ORDERS = [[5, 0, 3], [2, 4, 1]]
MODES = {
    "dynamic": lambda longest: ("dynamic", longest),
    "max": lambda longest: ("max", 512),
    "bucket": lambda longest: ("bucket", next(b for b in (64, 128, 256, 512) if b >= longest)),
    "multiple_of_8": lambda longest: ("dynamic", pad_length(longest, 8, 512)),
}


def test_texts_span_the_lengths_that_matter(ex: EncoderExecutor) -> None:
    lengths = [len(x) for x in ex.tokenize(TEXTS)]
    assert min(lengths) <= 4 and 256 < max(lengths) <= 512, lengths


@pytest.mark.parametrize("mode", sorted(MODES))
def test_parity_with_sentence_transformers_in_mixed_batches(
    ex: EncoderExecutor, reference: np.ndarray, mode: str
) -> None:
    ids = ex.tokenize(TEXTS)
    for order in ORDERS + ([list(range(len(TEXTS)))] if mode == "dynamic" else []):
        sub = [ids[i] for i in order]
        padding, width = MODES[mode](max(len(x) for x in sub))
        out = np.stack(ex.run(ex.prepare(batch_of(sub, padding, width))))
        assert out.dtype == np.float32 and out.shape == (len(order), 384)
        assert cosines(out, reference[order]).min() >= COS_MIN, (mode, order)
        np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)  # Normalize module honoured


def test_left_padding_matches(reference: np.ndarray) -> None:
    left = EncoderExecutor(EncoderConfig(device="cpu", padding_side="left"))
    ids = left.tokenize(TEXTS)
    prepared = left.prepare(batch_of(ids, "dynamic", max(len(x) for x in ids)))
    t = prepared.staged.tensors  # type: ignore[union-attr]
    assert t["attention_mask"][0, -1] == 1 and t["attention_mask"][0, 0] == 0  # really left-aligned
    assert cosines(np.stack(left.run(prepared)), reference).min() >= COS_MIN


def test_hf_forward_equals_lean_forward(ex: EncoderExecutor, reference: np.ndarray) -> None:
    assert ex.forward_impl == "lean"  # MiniLM is a BERT: the lean forward must have passed its probe
    ids = ex.tokenize(TEXTS)
    batch = batch_of(ids, "dynamic", max(len(x) for x in ids))
    lean = np.stack(ex.run(ex.prepare(batch)))
    saved, ex.lean = ex.lean, None
    try:
        hf = np.stack(ex.run(ex.prepare(batch)))
    finally:
        ex.lean = saved
    assert np.abs(lean - hf).max() < 1e-4
    assert cosines(hf, reference).min() >= COS_MIN


def test_padding_none_is_padding_free_or_says_what_is_missing(
    ex: EncoderExecutor, reference: np.ndarray
) -> None:
    ids = ex.tokenize(TEXTS)
    batch = make_batch(ids, "none", ex.max_length)
    if importlib.util.find_spec("batchpilot.models.ragged") is None:
        with pytest.raises(RuntimeError, match="padding-free"):
            ex.prepare(batch)
        return
    assert cosines(np.stack(ex.run(ex.prepare(batch))), reference).min() >= COS_MIN


def test_prepare_pads_to_the_planned_width(ex: EncoderExecutor) -> None:
    ids = [[101, 7, 102], [101, 7, 8, 9, 10, 102]]
    for padding, width in (("dynamic", 6), ("bucket", 64), ("max", 512)):
        t = ex.prepare(batch_of(ids, padding, width)).staged.tensors  # type: ignore[union-attr]
        assert t["input_ids"].shape == (2, width) and t["input_ids"].dtype == torch.int64
        assert t["attention_mask"].sum(dim=1).tolist() == [3, 6]
        assert (t["input_ids"][0, 3:] == ex.pad_id).all()
    t = ex.prepare(batch_of(ids, "max", 1024)).staged.tensors  # type: ignore[union-attr]
    assert t["input_ids"].shape == (2, 512)  # a planner max_len past the model's limit is capped
    with pytest.raises(ValueError, match="padded_len 4 < longest input 6"):
        ex.prepare(batch_of(ids, "dynamic", 4))


def test_pad_to_multiple_of_in_the_executor(ex: EncoderExecutor) -> None:
    saved = ex.config
    ex.config = replace(saved, pad_to_multiple_of=8)  # prepare reads it per batch; no second model load
    try:
        t = ex.prepare(batch_of([[101, 5, 102]], "dynamic", 3)).staged.tensors  # type: ignore[union-attr]
        assert t["input_ids"].shape == (1, 8)
        long = batch_of([[101] + [5] * 509 + [102]], "dynamic", 511)
        assert ex.prepare(long).staged.tensors["input_ids"].shape == (1, 512)  # type: ignore[union-attr]
    finally:
        ex.config = saved


def test_model_facts_and_limits(ex: EncoderExecutor) -> None:
    assert (ex.dim, ex.max_length, ex.model_name) == (384, 512, "all-MiniLM-L6-v2")
    assert ex.pooling == PoolingConfig(modes=("mean",), normalize=True)
    assert ex.st.max_seq_length == 256  # the embedded default serves past its folder's cap, to 512
    assert torch.get_num_threads() == ex.num_threads >= 1
    with pytest.raises(ValueError, match="position limit of 512"):
        EncoderExecutor(EncoderConfig(device="cpu", max_length=600))
    with pytest.raises(ValueError, match="padding_side"):
        EncoderConfig(padding_side="middle")  # type: ignore[arg-type]


def test_tokenize_rejects_or_truncates_long_input(ex: EncoderExecutor) -> None:
    long_text = " ".join(_WORDS[:900])
    with pytest.raises(ValueError, match="input 1 has .* tokens but all-MiniLM-L6-v2 accepts at most 512"):
        ex.tokenize(["short", long_text])
    ids = ex.tokenize([long_text], truncate=True)[0]
    assert len(ids) == 512 and ids[0] == ex.tokenizer.cls_token_id and ids[-1] == ex.tokenizer.sep_token_id
    assert ids == ex.tokenizer(long_text, truncation=True, max_length=512)["input_ids"]  # HF's own rule


def test_token_id_inputs(ex: EncoderExecutor, reference: np.ndarray) -> None:
    text_ids = ex.tokenize(TEXTS[:3])
    raw = [x[1:-1] for x in text_ids]  # what a client sends: ids without [CLS]/[SEP]
    assert ex.tokenize_ids(raw) == text_ids
    assert ex.tokenize_ids(text_ids) == text_ids  # already wrapped: left alone
    assert cosines(ex.encode(ex.tokenize_ids(raw)), reference[:3]).min() >= COS_MIN
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ex.tokenize_ids([[5, 40000]])
    assert len(ex.tokenize_ids([[5] * 600], truncate=True)[0]) == 512
    with pytest.raises(ValueError, match="accepts at most 512"):
        ex.tokenize_ids([[5] * 600])


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("mode", POOLING_MODES)
def test_pool_equals_sentence_transformers_pooling(mode: str, side: str) -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 9, 16, generator=gen)
    mask = torch.zeros(3, 9, dtype=torch.int64)
    for i, n in enumerate((9, 4, 1)):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, 9 - n :] = 1
    ref = STPooling(16, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})
    got = pool(hidden, mask, PoolingConfig(modes=(mode,)))
    torch.testing.assert_close(got, ref["sentence_embedding"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["cls", "max"])
def test_any_local_hf_encoder_with_its_own_pooling(tmp_path: Path, ex: EncoderExecutor, mode: str) -> None:
    """A tiny random BERT saved locally with CLS / max pooling and no Normalize: same vectors as ST,
    padded and padding-free (max pooling takes the executor's re-pad path after the ragged forward)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=ex.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(tmp_path)
    ex.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32,
                                                                    "pooling_mode": mode}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    tiny = EncoderExecutor(EncoderConfig(model_path=str(tmp_path), device="cpu"))
    assert (tiny.dim, tiny.max_length, tiny.model_name) == (32, 128, tmp_path.name)
    assert tiny.pooling.modes == (mode,) and not tiny.pooling.normalize
    texts = ["a b", "a longer sentence about queues and batches", "x"]
    st = SentenceTransformer(str(tmp_path), device="cpu")
    st.max_seq_length = 128
    ref = st.encode(texts)
    for padding in ("dynamic", "none"):
        got = tiny.encode(texts, padding=padding)
        assert cosines(got, ref).min() >= COS_MIN, padding
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_side_stream_copy(reference: np.ndarray) -> None:
    gpu = EncoderExecutor(EncoderConfig(device="cuda"))
    prepared = gpu.prepare(batch_of(gpu.tokenize(TEXTS), "dynamic", 512))
    staged = prepared.staged
    assert staged is not None and staged.ready is not None  # copy issued on the side stream, event recorded
    assert all(t.is_cuda for t in staged.tensors.values())
    assert cosines(np.stack(gpu.run(prepared)), reference).min() >= COS_MIN


def test_model_folder_config_is_read_or_refused(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"},
    ]))
    with pytest.raises(ValueError, match="LayerNorm.* is not supported"):
        STModules.from_model_dir(tmp_path)
    (tmp_path / "modules.json").unlink()
    assert STModules.from_model_dir(tmp_path).pooling == PoolingConfig()  # plain HF folder: ST's default
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}))
    assert STModules.from_model_dir(tmp_path).pooling.modes == ("cls", "max")  # legacy flags, ST's order
