"""Sequence-classification executor against sentence-transformers' CrossEncoder and HF, on seeded models.

Models are built once per module (2 layers, MiniLM's vocab and width) by models/seeded.py; references are
each input run alone (no padding at all), so a batch's padding may not move a score by more than 1e-5.
"""

from __future__ import annotations

import json
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sentence_transformers import CrossEncoder
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from batchpilot.core.batch import Batch
from batchpilot.core.costmodel import BatchShape
from batchpilot.core.request import Request
from batchpilot.models.cross_encoder import (
    ClassifierConfig,
    PairTokens,
    SequenceClassifierExecutor,
    activate,
    make_pair_batch,
)
from batchpilot.models.seeded import MARKER, build_classifier, build_cross_encoder, main
from batchpilot.models.tokens import InvalidInput

TOL = 1e-5
_WORDS = " ".join(topics[k] for k in sorted(topics)).split()


def words(start: int, n: int) -> str:
    return " ".join(_WORDS[start : start + n])


# mixed lengths in one batch: from a few tokens to a few hundred
PAIRS = [("what is a generator?", words(0, 4)), (words(900, 12), words(1000, 90)), ("q", "d"),
         ("how do closures work", words(3000, 200)), (words(5000, 40), words(6000, 25))]
TEXTS = ["Great!", words(8000, 30), words(9000, 200), "not sure", words(10000, 6)]
LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module")
def ce_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_cross_encoder(tmp_path_factory.mktemp("models") / "ce", seed=0, layers=2)


@pytest.fixture(scope="module")
def clf_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_classifier(tmp_path_factory.mktemp("models") / "clf", labels=LABELS, seed=1, layers=2)


@pytest.fixture(scope="module")
def ex(ce_path: str) -> SequenceClassifierExecutor:
    return SequenceClassifierExecutor(ClassifierConfig(ce_path, device="cpu"))


@pytest.fixture(scope="module")
def clf(clf_path: str) -> SequenceClassifierExecutor:
    return SequenceClassifierExecutor(ClassifierConfig(clf_path, device="cpu"))


@pytest.fixture(scope="module")
def st_ce(ce_path: str) -> CrossEncoder:
    model: CrossEncoder = CrossEncoder(ce_path, device="cpu")
    return model


def hf_logits(path: str, texts: list[str]) -> np.ndarray:
    """Each text through HF alone (no padding)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return np.stack([model(**tok(t, return_tensors="pt")).logits[0].numpy() for t in texts])


def test_cross_encoder_metadata(ex: SequenceClassifierExecutor) -> None:
    assert (ex.task, ex.activation, ex.num_labels, ex.labels) == ("score", "sigmoid", 1, ["LABEL_0"])
    assert (ex.max_length, ex.vocab_size, ex.model_name, ex.dim) == (512, 30522, "ce", 1)
    assert not ex.supports_padding_free()
    lengths = [len(r) for r in ex.tokenize_pairs(PAIRS)]
    assert min(lengths) <= 5 and 256 < max(lengths) <= 512, lengths


def test_scores_match_sentence_transformers_in_mixed_batches(
    ex: SequenceClassifierExecutor, st_ce: CrossEncoder
) -> None:
    alone = np.array([st_ce.predict([p])[0] for p in PAIRS])
    st_batched = st_ce.predict(PAIRS)
    raw_alone = np.array([st_ce.predict([p], activation_fn=torch.nn.Identity())[0] for p in PAIRS])
    got = ex.predict_pairs(PAIRS)
    assert got.shape == (len(PAIRS),) and got.dtype == np.float32
    diffs = [np.abs(got - alone).max(), np.abs(got - st_batched).max()]
    rows = ex.tokenize_pairs(PAIRS)
    order = [3, 2, 0, 4, 1]
    for padding in ("dynamic", "max"):  # max: everything padded to 512
        batch = make_pair_batch([rows[i] for i in order], padding, ex.max_length)
        logits = np.stack(ex.run(ex.prepare(batch)))
        assert logits.shape == (len(PAIRS), 1)
        diffs.append(np.abs(logits[:, 0] - raw_alone[order]).max())
        diffs.append(np.abs(ex.scores(logits)[:, 0] - alone[order]).max())
    assert max(diffs) < TOL, diffs
    # the comparison would see a broken mask: attending to the padding moves scores by far more
    t = ex.prepare(make_pair_batch(rows, "max", ex.max_length)).wait()
    with torch.inference_mode():
        unmasked = ex.model(**{**t, "attention_mask": torch.ones_like(t["attention_mask"])}).logits
    assert np.abs(unmasked[:, 0].numpy() - raw_alone).max() > 100 * TOL


def test_token_type_ids_follow_the_pair(ex: SequenceClassifierExecutor) -> None:
    tok = AutoTokenizer.from_pretrained(ex.model_path)
    rows = ex.tokenize_pairs(PAIRS)
    for (q, d), row in zip(PAIRS, rows, strict=True):
        ref = tok(q, d)
        assert row.token_ids == ref["input_ids"] and row.type_ids == ref["token_type_ids"]
    t = ex.prepare(make_pair_batch(rows, "dynamic", ex.max_length)).wait()
    assert set(t) == {"input_ids", "attention_mask", "token_type_ids"}
    longest = max(len(r) for r in rows)
    assert t["input_ids"].shape == (len(rows), longest)
    assert t["token_type_ids"][2].tolist() == rows[2].type_ids + [0] * (longest - len(rows[2]))
    assert t["input_ids"][2, len(rows[2]) :].eq(ex.pad_id).all()


def test_classify_matches_hf_softmax(clf: SequenceClassifierExecutor, clf_path: str) -> None:
    assert (clf.task, clf.activation, clf.labels, clf.num_labels) == ("classify", "softmax", list(LABELS), 3)
    logits = hf_logits(clf_path, TEXTS)
    ref = torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
    got = clf.classify(TEXTS)
    assert got.shape == (len(TEXTS), 3)
    assert np.abs(got - ref).max() < TOL
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-6)


def test_multi_label_classifier_uses_sigmoid(tmp_path: Path) -> None:
    path = build_classifier(tmp_path / "ml", labels=("a", "b", "c", "d"), seed=2, multi_label=True, layers=1)
    ml = SequenceClassifierExecutor(ClassifierConfig(path, device="cpu", model_name="ml"))
    assert (ml.activation, ml.labels, ml.model_name) == ("sigmoid", ["a", "b", "c", "d"], "ml")
    ref = torch.sigmoid(torch.from_numpy(hf_logits(path, TEXTS))).numpy()
    assert np.abs(ml.classify(TEXTS) - ref).max() < TOL


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("sentence_transformers", {"activation_fn": "torch.nn.modules.linear.Identity"}, "none"),
    ("sbert_ce_default_activation_function", "torch.nn.modules.linear.Identity", "none"),
    ("sentence_transformers", {"activation_fn": "torch.nn.modules.activation.Sigmoid"}, "sigmoid"),
])
def test_sentence_transformers_activation_entry_is_honoured(
    ce_path: str, tmp_path: Path, key: str, value: object, expected: str
) -> None:
    path = tmp_path / "ce_st"
    shutil.copytree(ce_path, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))
    ex = SequenceClassifierExecutor(ClassifierConfig(str(path), device="cpu"))
    assert ex.activation == expected
    ref = np.array([CrossEncoder(str(path), device="cpu").predict([p])[0] for p in PAIRS[:3]])
    assert np.abs(ex.predict_pairs(PAIRS[:3]) - ref).max() < TOL


def test_truncation_matches_hf_longest_first(ce_path: str) -> None:
    short = SequenceClassifierExecutor(ClassifierConfig(ce_path, device="cpu", max_length=64))
    tok = AutoTokenizer.from_pretrained(ce_path)
    pairs = [(words(0, 80), words(200, 30)), (words(400, 5), words(500, 120)),
             (words(700, 60), words(800, 70)), ("short", "pair")]
    for (q, d), row in zip(pairs, short.tokenize_pairs(pairs, truncate=True), strict=True):
        ref = tok(q, d, truncation="longest_first", max_length=64)
        assert row.token_ids == ref["input_ids"] and row.type_ids == ref["token_type_ids"]
        assert len(row) <= 64
    long_text = words(1200, 100)
    (row,) = short.tokenize([long_text], truncate=True)
    assert row.token_ids == tok(long_text, truncation=True, max_length=64)["input_ids"]
    assert len(row) == 64 and row.token_ids[-1] == tok.sep_token_id
    with pytest.raises(InvalidInput, match=r"input 2 has \d+ tokens but ce accepts at most 64") as err:
        short.tokenize_pairs(pairs[-1:] * 2 + pairs[:1])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidInput, match="at most 64") as err:
        short.tokenize([long_text])
    assert err.value.code == "context_length_exceeded"


def test_tokenize_ids_validates_and_wraps(clf: SequenceClassifierExecutor) -> None:
    with pytest.raises(InvalidInput, match="token id 30522 is outside the vocabulary") as err:
        clf.tokenize_ids([[2054], [2054, 30522]])
    assert err.value.code == "invalid_token_id"
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        clf.tokenize_ids([[-1]])
    bare, wrapped = clf.tokenize_ids([[2054, 2003], [101, 2054, 2003, 102]])
    assert bare == wrapped == PairTokens([101, 2054, 2003, 102], [0, 0, 0, 0])
    (cut,) = clf.tokenize_ids([[2054] * 600], truncate=True)
    assert len(cut) == 512 and cut.token_ids[0] == 101 and cut.token_ids[-1] == 102
    with pytest.raises(InvalidInput) as err:
        clf.tokenize_ids([[2054] * 600])
    assert err.value.code == "context_length_exceeded"
    ids = clf.tokenize(TEXTS[:2])
    from_ids = clf.tokenize_ids([r.token_ids for r in ids])
    np.testing.assert_array_equal(clf._predict(from_ids), clf.classify(TEXTS[:2]))


def test_prepare_contract(ex: SequenceClassifierExecutor) -> None:
    rows = ex.tokenize_pairs(PAIRS[:3])
    longest = max(len(r) for r in rows)
    reqs = [Request(id=i, arrival=0.0, length=len(r), payload=r) for i, r in enumerate(rows)]
    lengths = [len(r) for r in rows]
    short = Batch(3, reqs, longest - 1, BatchShape.padded(lengths, longest - 1), "dynamic", 0.0)
    with pytest.raises(ValueError, match=f"padded_len {longest - 1} < longest input {longest}"):
        ex.prepare(short)
    past = Batch(4, reqs, 1024, BatchShape.padded(lengths, 1024), "max", 0.0)  # planner past the limit
    assert ex.prepare(past).wait()["input_ids"].shape == (3, 512)
    ragged = Batch(5, reqs, longest, BatchShape.ragged(lengths), "none", 0.0)
    np.testing.assert_allclose(np.stack(ex.run(ex.prepare(ragged)))[:, 0],
                               np.stack(ex.run(ex.prepare(past)))[:, 0], atol=TOL)
    with pytest.raises(ValueError, match="payload must be PairTokens"):
        ex.prepare(Batch(6, [Request(id=0, arrival=0.0, length=1, payload="text")], 1,
                         BatchShape.padded([1], 1), "dynamic", 0.0))
    assert ex.predict_pairs([]).shape == (0,)
    ex.warmup()


def test_tokenisation_is_thread_safe(ex: SequenceClassifierExecutor) -> None:
    expect = {False: ex.tokenize_pairs(PAIRS), True: ex.tokenize_pairs(PAIRS, truncate=True)}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: (i % 2 == 1, ex.tokenize_pairs(PAIRS, truncate=i % 2 == 1)), range(40)))
    assert all(rows == expect[trunc] for trunc, rows in got)


def test_activate_is_stable() -> None:
    x = np.array([[-1000.0, 0.0, 1000.0], [3.0, 3.0, 3.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm, sg = activate(x, "softmax"), activate(x, "sigmoid")
    np.testing.assert_allclose(sm, np.array([[0, 0, 1], [1 / 3] * 3]), atol=1e-7)
    np.testing.assert_allclose(sg, np.array([[0, 0.5, 1], [0.9525741] * 3]), atol=1e-6)
    np.testing.assert_array_equal(activate(x, "none"), x)
    with pytest.raises(ValueError, match="activation 'relu'"):
        activate(x, "relu")


def test_config_validation(ce_path: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        ClassifierConfig(ce_path, dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 3"):
        ClassifierConfig(ce_path, max_length=2)
    with pytest.raises(ValueError, match="num_threads"):
        ClassifierConfig(ce_path, num_threads=0)
    with pytest.raises(ValueError, match="position limit of 512"):
        SequenceClassifierExecutor(ClassifierConfig(ce_path, device="cpu", max_length=513))


def test_seeded_builds_are_deterministic_and_idempotent(ce_path: str, tmp_path: Path) -> None:
    stamp = (Path(ce_path) / "model.safetensors").stat().st_mtime_ns
    assert build_cross_encoder(ce_path, seed=0, layers=2) == ce_path  # same arguments: nothing rebuilt
    assert (Path(ce_path) / "model.safetensors").stat().st_mtime_ns == stamp
    again = build_cross_encoder(tmp_path / "again", seed=0, layers=2)
    a, b = load_file(f"{ce_path}/model.safetensors"), load_file(f"{again}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    np.testing.assert_array_equal(hf_logits(ce_path, TEXTS[:2]), hf_logits(again, TEXTS[:2]))
    other = build_cross_encoder(tmp_path / "again", seed=5, layers=2)  # other arguments: rebuilt in place
    assert json.loads((Path(other) / MARKER).read_text())["seed"] == 5
    assert not np.allclose(hf_logits(ce_path, TEXTS[:2]), hf_logits(other, TEXTS[:2]))
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temporary folders left behind
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a seeded checkpoint"):
        build_cross_encoder(foreign, layers=1)
    with pytest.raises(ValueError, match="distinct"):
        build_classifier(tmp_path / "dup", labels=("a", "a"))


def test_cli_builds_a_classifier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["classifier", str(out), "--layers", "1", "--labels", "x, y", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["id2label"], cfg["problem_type"]) == (
        1, {"0": "x", "1": "y"}, "single_label_classification")
    model = AutoModelForSequenceClassification.from_pretrained(str(out))
    assert model.config.num_labels == 2
