"""The encoder families people deploy, against sentence-transformers on the same weights.

Per family (DistilBERT, MPNet, ModernBERT, Qwen3 as Qwen3-Embedding, Gemma3 as EmbeddingGemma; tiny
seeded checkpoints from ``models/seeded_families.py``, built once per session): every vector of a
mixed-length batch equals ``SentenceTransformer(folder).encode`` of that text alone (no padding at all)
with cosine >= 0.99999 in float32, on the padded path and, for the families that have one, the
padding-free path; bfloat16 passes the accuracy guard (``models/precision.py``); the checkpoint's
prompts (its default, and each by name) give sentence-transformers' ``encode(..., prompt_name=...)``;
an unknown ``prompt_name`` is a 400 over the real server; a module batchpilot does not run is refused.

The references would also pass a broken forward if the vectors were degenerate, so each family's
references are checked to tell texts apart (``test_the_references_tell_texts_and_prompts_apart``).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForSequenceClassification

from batchpilot.bench.serverproc import free_port, serve
from batchpilot.models.cross_encoder import ClassifierConfig, SequenceClassifierExecutor, make_pair_batch
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, make_batch
from batchpilot.models.precision import DEFAULT_MIN_COSINE
from batchpilot.models.seeded_families import FAMILIES, build_family, build_family_classifier
from batchpilot.models.st_modules import Dense, STModules
from batchpilot.models.tasks import load_model
from batchpilot.models.tokens import InvalidInput

COS_MIN = 0.99999
_WORDS = " ".join(topics[k] for k in sorted(topics)).split()
# from a couple of tokens to a few hundred (the longest is cut at Qwen3's 128-token cap)
TEXTS = ["Hi!"] + [" ".join(_WORDS[i * 700 : i * 700 + n]) for i, n in enumerate((6, 30, 100, 160), 1)]
PADDING_FREE = {"distilbert": True, "mpnet": True, "modernbert": False, "qwen3": False, "gemma3": False}
# (family, prompt name) for every prompt of every family, None = the checkpoint's default
PROMPTS = [(f, None) for f, spec in FAMILIES.items() if spec.prompts] + [
    (f, name) for f, spec in FAMILIES.items() for name in spec.prompts]


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(family, root / family) for family in FAMILIES}


_EXECUTORS: dict[tuple[str, str], EncoderExecutor] = {}
_ST: dict[str, SentenceTransformer] = {}


def executor(folders: dict[str, str], family: str, padding_side: str = "right") -> EncoderExecutor:
    key = (family, padding_side)
    if key not in _EXECUTORS:
        _EXECUTORS[key] = EncoderExecutor(EncoderConfig(model_path=folders[family], device="cpu",
                                                        padding_side=padding_side))  # type: ignore[arg-type]
    return _EXECUTORS[key]


def reference(folders: dict[str, str], family: str, prompt_name: str | None = None,
              prompt: str | None = None) -> np.ndarray:
    """sentence-transformers' vectors, one text at a time (no padding)."""
    if family not in _ST:
        _ST[family] = SentenceTransformer(folders[family], device="cpu")
    st = _ST[family]
    return np.stack([st.encode(t, prompt_name=prompt_name, prompt=prompt) for t in TEXTS])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def embed(ex: EncoderExecutor, padding: str, prompt_name: str | None = None) -> np.ndarray:
    """All texts in one mixed-length batch, cut at the model's limit as sentence-transformers cuts them."""
    ids = ex.tokenize(TEXTS, truncate=True, prompt_name=prompt_name)
    return np.stack(ex.run(ex.prepare(make_batch(ids, padding, ex.max_length))))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_references_tell_texts_and_prompts_apart(folders: dict[str, str], family: str) -> None:
    """A parity check is only as strong as its references are distinct: different texts (and, where a
    checkpoint has prompts, the same text with another prompt) are far below the parity threshold."""
    ref = reference(folders, family)
    assert cosines(ref[1:], ref[:-1]).max() < 0.99
    for name, text in FAMILIES[family].prompts.items():
        if text:
            plain = reference(folders, family, prompt="")
            assert cosines(reference(folders, family, name), plain).max() < 0.999


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_equals_sentence_transformers_on_every_path_the_family_has(
    folders: dict[str, str], family: str
) -> None:
    ex = executor(folders, family)
    ref = reference(folders, family)
    assert ex.dim == ref.shape[1]
    assert ex.supports_padding_free() is PADDING_FREE[family], ex.padding_free_reason
    assert ex.forward_impl == ("lean" if PADDING_FREE[family] else "hf")
    lengths = [len(x) for x in ex.tokenize(TEXTS, truncate=True)]
    assert min(lengths) <= 8 and max(lengths) > 100, lengths  # short next to long in one batch
    for padding in ("dynamic", "none") if PADDING_FREE[family] else ("dynamic",):
        got = embed(ex, padding)
        assert cosines(got, ref).min() >= COS_MIN, padding
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)


@pytest.mark.parametrize("family", ["modernbert", "qwen3", "gemma3"])
def test_a_family_without_a_padding_free_path_says_why(folders: dict[str, str], family: str) -> None:
    ex = executor(folders, family)
    assert ex.padding_free_reason is not None and ex.model.config.model_type in ex.padding_free_reason
    with pytest.raises(RuntimeError, match="has no padding-free forward"):
        ex.prepare(make_batch([[5, 6, 7]], "none", ex.max_length))


def test_the_padded_path_is_logged_once_with_its_reason(folders: dict[str, str], tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    folder = shutil.copytree(folders["modernbert"], tmp_path / "modernbert")  # a path not loaded before
    with caplog.at_level(logging.INFO, logger="batchpilot.models"):
        for _ in range(2):  # as --dtype auto loads a model once per precision
            EncoderExecutor(EncoderConfig(model_path=str(folder), device="cpu"))
    said = [r.getMessage() for r in caplog.records if "HF's padded forward" in r.getMessage()]
    assert len(said) == 1 and "rotary positions and alternating local/global attention" in said[0], said


@pytest.mark.parametrize(("family", "prompt_name"), PROMPTS)
def test_prompts_equal_sentence_transformers(folders: dict[str, str], family: str,
                                             prompt_name: str | None) -> None:
    ex = executor(folders, family)
    ref = reference(folders, family, prompt_name)
    for padding in ("dynamic", "none") if PADDING_FREE[family] else ("dynamic",):
        assert cosines(embed(ex, padding, prompt_name), ref).min() >= COS_MIN, padding


def test_qwen3_appends_eos_pools_the_last_token_and_left_pads_the_same(folders: dict[str, str]) -> None:
    right, left = executor(folders, "qwen3"), executor(folders, "qwen3", "left")
    eos = right.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = right.tokenize([TEXTS[0], TEXTS[4]], truncate=True)
    assert [x[-1] for x in ids] == [eos, eos] and len(ids[1]) == right.max_length == 128
    assert right.tokenize_ids([ids[0][:-1]]) == [ids[0]]  # client ids get the EOS the tokenizer adds
    prepared = left.prepare(make_batch(ids, "dynamic", left.max_length))
    mask = prepared.staged.tensors["attention_mask"]  # type: ignore[union-attr]
    assert mask[0, 0] == 0 and mask[0, -1] == 1  # really left-aligned
    ref = reference(folders, "qwen3")
    assert cosines(np.stack(left.run(prepared)), ref[[0, 4]]).min() >= COS_MIN
    for ex in (right, left):
        assert cosines(embed(ex, "dynamic"), ref).min() >= COS_MIN


def test_max_seq_length_caps_the_default_max_length(folders: dict[str, str]) -> None:
    assert executor(folders, "qwen3").max_length == 128  # its sentence-transformers config: 128 of 512
    assert executor(folders, "gemma3").max_length == 512  # 2048 in the config, 512 positions
    wider = EncoderExecutor(EncoderConfig(model_path=folders["qwen3"], device="cpu", max_length=300))
    assert wider.max_length == 300  # an explicit max_length wins, up to the position limit
    with pytest.raises(InvalidInput, match="accepts at most 128"):
        executor(folders, "qwen3").tokenize([TEXTS[4]])
    # the prompt's tokens count towards the limit
    ex = executor(folders, "qwen3")
    plain = ex.tokenize([TEXTS[2]])[0]
    assert len(ex.tokenize([TEXTS[2]], prompt_name="query")[0]) > len(plain) + 10


def test_dense_modules_and_normalize_run_after_pooling(folders: dict[str, str]) -> None:
    st = STModules.from_model_dir(folders["gemma3"])
    assert [m.out_features if isinstance(m, Dense) else m for m in st.after] == [128, 64, "normalize"]
    assert not st.pooling.normalize and st.normalize and st.dim(64) == 64
    ex = executor(folders, "gemma3")
    assert ex.dim == 64 and ex.normalizes


@pytest.mark.parametrize("residual", [False, True])
def test_dense_loads_what_sentence_transformers_saves(tmp_path: Path, residual: bool) -> None:
    """A Dense module saved by sentence-transformers itself (default Tanh, pytorch_model.bin, with and
    without its residual projection) computes what sentence-transformers computes."""
    from sentence_transformers.sentence_transformer.modules import Dense as STDense

    torch.manual_seed(0)
    module = STDense(16, 8, use_residual=residual)
    module.save(str(tmp_path), safe_serialization=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("activation_function")  # sentence-transformers' default when the config names none: Tanh
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    x = torch.randn(3, 16)
    with torch.inference_mode():
        want = module({"sentence_embedding": x})["sentence_embedding"]
        got = Dense.load(tmp_path)(x)
    torch.testing.assert_close(got, want)


def _with_modules(src: str, dst: Path, edit: object) -> Path:
    shutil.copytree(src, dst)
    modules = json.loads((dst / "modules.json").read_text())
    edit(modules)  # type: ignore[operator]
    (dst / "modules.json").write_text(json.dumps(modules))
    return dst


def test_unsupported_folders_are_refused_with_what_to_change(folders: dict[str, str], tmp_path: Path) -> None:
    layer_norm = {"idx": 5, "name": "5", "path": "5_LayerNorm",
                  "type": "sentence_transformers.models.LayerNorm"}
    bad = _with_modules(folders["gemma3"], tmp_path / "ln", lambda m: m.insert(2, layer_norm))
    with pytest.raises(ValueError, match=r"module 'sentence_transformers.models.LayerNorm' \(modules.json "
                                         r"entry 2\) is not supported"):
        EncoderExecutor(EncoderConfig(model_path=str(bad), device="cpu"))
    custom = {"idx": 5, "name": "5", "path": "", "type": "my_package.Dense"}
    bad = _with_modules(folders["gemma3"], tmp_path / "custom", lambda m: m.append(custom))
    with pytest.raises(ValueError, match="my_package.Dense"):
        STModules.from_model_dir(bad)
    dense_cfg = tmp_path / "act" / "2_Dense" / "config.json"
    shutil.copytree(folders["gemma3"], tmp_path / "act")
    dense_cfg.write_text(json.dumps({**json.loads(dense_cfg.read_text()),
                                     "activation_function": "my_package.Swish"}))
    with pytest.raises(ValueError, match="Dense activation 'my_package.Swish' is not supported"):
        STModules.from_model_dir(tmp_path / "act")
    pooling_cfg = tmp_path / "noprompt" / "1_Pooling" / "config.json"
    shutil.copytree(folders["mpnet"], tmp_path / "noprompt")
    pooling_cfg.write_text(json.dumps({**json.loads(pooling_cfg.read_text()), "include_prompt": False}))
    with pytest.raises(ValueError, match="include_prompt: false"):
        STModules.from_model_dir(tmp_path / "noprompt")


def test_prompt_names_are_checked(folders: dict[str, str]) -> None:
    ex = executor(folders, "qwen3")
    with pytest.raises(InvalidInput, match="unknown prompt_name 'passage'.*'query', 'document'"):
        ex.tokenize(["x"], prompt_name="passage")
    with pytest.raises(InvalidInput, match="defines no prompts"):
        executor(folders, "distilbert").tokenize(["x"], prompt_name="query")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_passes_the_accuracy_guard(folders: dict[str, str], family: str) -> None:
    ex = load_model(folders[family], dtype="bfloat16", num_threads=1)
    assert ex.precision.chosen == "bfloat16" and ex.precision.min_cosine >= DEFAULT_MIN_COSINE
    # the lean forward's probe against HF allows for half precision's rounding: the path is kept
    assert ex.supports_padding_free() is PADDING_FREE[family], ex.padding_free_reason
    assert cosines(embed(ex, "dynamic"), reference(folders, family)).min() >= DEFAULT_MIN_COSINE


@pytest.mark.parametrize("family", FAMILIES)
def test_classification_heads_load_and_equal_hf(folders: dict[str, str], family: str,
                                                tmp_path: Path) -> None:
    """Each family's ...ForSequenceClassification serves as a cross-encoder (sentence-transformers'
    CrossEncoder scores) and as a classifier (HF's logits), padded, in one mixed batch."""
    pairs = [("how do I reset my password", TEXTS[2]), ("q", "d"), ("what is a queue", TEXTS[3])]
    ce_path = build_family_classifier(family, tmp_path / "ce", num_labels=1, seed=3)
    ce = SequenceClassifierExecutor(ClassifierConfig(model_path=ce_path, device="cpu"))
    assert ce.task == "score"
    want = CrossEncoder(ce_path, device="cpu").predict(pairs)
    np.testing.assert_allclose(ce.predict_pairs(pairs), want, atol=1e-5)
    clf_path = build_family_classifier(family, tmp_path / "clf", num_labels=3, seed=4)
    clf = SequenceClassifierExecutor(ClassifierConfig(model_path=clf_path, device="cpu"))
    rows = clf.tokenize(TEXTS, truncate=True)
    logits = np.stack(clf.run(clf.prepare(make_pair_batch(rows, "dynamic", clf.max_length))))
    hf = AutoModelForSequenceClassification.from_pretrained(clf_path).eval()
    for i, row in enumerate(rows):  # each text alone: no padding
        with torch.inference_mode():
            alone = hf(input_ids=torch.tensor([row.token_ids])).logits[0].numpy()
        np.testing.assert_allclose(logits[i], alone, atol=1e-4)


@pytest.fixture(scope="module")
def server(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real ``batchpilot serve`` on a free port, serving MPNet (a default prompt) and Qwen3."""
    log_dir = tmp_path_factory.mktemp("serve")
    args = ["--model", folders["mpnet"], "--model-name", "mpnet", "--model", folders["qwen3"],
            "--model-name", "qwen3", "--no-startup-profile", "--threads", "1", "--dtype", "float32",
            "--padding", "none"]
    with serve(args, port=free_port(), log_path=log_dir / "serve.log") as url:
        yield url


def test_prompts_over_the_real_server(server: str, folders: dict[str, str]) -> None:
    def post(body: dict[str, object]) -> httpx.Response:
        return httpx.post(server + "/v1/embeddings", json=body, timeout=60)

    r = post({"model": "qwen3", "input": TEXTS[:3], "prompt_name": "passage"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_prompt_name" and err["param"] == "prompt_name"
    assert "'passage'" in err["message"] and "'query', 'document'" in err["message"]
    for model, prompt_name in (("qwen3", "query"), ("mpnet", None), ("mpnet", "query")):
        body: dict[str, object] = {"model": model, "input": TEXTS[:3]}
        if prompt_name is not None:
            body["prompt_name"] = prompt_name
        r = post(body)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        assert cosines(got, reference(folders, model, prompt_name)[:3]).min() >= COS_MIN, (model, prompt_name)
        ex = executor(folders, model)  # usage counts the prompt's tokens
        assert r.json()["usage"]["prompt_tokens"] == sum(len(x) for x in ex.tokenize(TEXTS[:3], False,
                                                                                       prompt_name))
