"""One real ``batchpilot serve`` with three models: the embedded MiniLM, a seeded cross-encoder and a
seeded classifier (models/seeded.py, 2 layers), each detected from its checkpoint and given its own
scheduler. Answers are checked against sentence-transformers and HF run on the same folders, and the
embedding options against a NumPy reference written here.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from conftest import running_server
from inproc import scrape
from openai import OpenAI
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from batchpilot.models.encoder import default_model_path
from batchpilot.models.seeded import build_classifier, build_cross_encoder

TOL = 1e-5
LABELS = ("negative", "neutral", "positive")
QUERY = "how do I reset my password"
DOCS = ["Open settings and choose 'forgot password' to get a reset link by email.",
        "Our office is closed on public holidays.",
        "Passwords must be at least twelve characters long.",
        "reset",
        "To change the password of an account you are signed in to, go to Security, then Password. " * 4,
        "Bananas are rich in potassium."] * 4  # 24 documents: more than one batch of 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("models")
    return {"reranker": build_cross_encoder(d / "reranker", seed=3, layers=2),
            "classifier": build_classifier(d / "classifier", labels=LABELS, seed=4, layers=2)}


@pytest.fixture(scope="module")
def url(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("multi")
    cfg = d / "sched.yaml"
    cfg.write_text("encoder:\n  policy: {name: window, max_batch_size: 8, max_wait_s: 0.01}\n")
    args = ["--model", default_model_path(), "--model-name", "embedder",
            "--model", folders["reranker"], "--model-name", "reranker",
            "--model", folders["classifier"], "--model-name", "classifier",
            "--config", str(cfg), "--no-startup-profile", "--threads", "1", "--dtype", "float32"]
    with running_server(args, d) as u:
        yield u


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_each_model_is_listed_with_the_task_read_from_its_checkpoint(url: str) -> None:
    cards = {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}
    assert {k: c["task"] for k, c in cards.items()} == {
        "embedder": "embed", "reranker": "score", "classifier": "classify"}
    assert cards["embedder"]["dimensions"] == 384
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["models"] == ["embedder", "reranker", "classifier"]


def test_rerank_orders_by_the_cross_encoders_score(url: str, folders: dict[str, str]) -> None:
    r = post(url, "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = CrossEncoder(folders["reranker"], device="cpu").predict([(QUERY, d) for d in DOCS])
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert sorted(got) == list(range(len(DOCS)))
    assert max(abs(got[i] - float(want[i])) for i in got) <= TOL
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in body["results"])
    assert body["model"] == "reranker" and body["usage"]["total_tokens"] > len(DOCS)
    top = post(url, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3,
                                "return_documents": False}).json()  # default model of the task
    assert [x["index"] for x in top["results"]] == [x["index"] for x in body["results"][:3]]
    assert all("document" not in x for x in top["results"])


def test_a_reranks_pairs_are_split_across_batches_and_all_answered(url: str) -> None:
    def batches() -> float:
        return scrape(url, by_model=True)["batchpilot_batch_size_count{model=reranker}"]

    before = batches()
    assert post(url, "/v1/rerank", {"query": QUERY, "documents": DOCS}).status_code == 200
    assert batches() - before >= 3  # 24 pairs, at most 8 per batch
    per_model = scrape(url, by_model=True)
    assert per_model["batchpilot_http_requests_total{model=reranker,route=/v1/rerank,status=200}"] >= 1


def test_score_pairs_one_to_many_and_pairwise_in_input_order(url: str, folders: dict[str, str]) -> None:
    ce = CrossEncoder(folders["reranker"], device="cpu")
    one = post(url, "/v1/score", {"text_1": QUERY, "text_2": DOCS[:5]}).json()
    assert [x["index"] for x in one["data"]] == list(range(5))
    want = ce.predict([(QUERY, d) for d in DOCS[:5]])
    assert max(abs(x["score"] - float(w)) for x, w in zip(one["data"], want, strict=True)) <= TOL
    pairwise = post(url, "/score", {"text_1": DOCS[:3], "text_2": DOCS[3:6]}).json()
    want = ce.predict(list(zip(DOCS[:3], DOCS[3:6], strict=True)))
    assert max(abs(x["score"] - float(w)) for x, w in zip(pairwise["data"], want, strict=True)) <= TOL
    bad = post(url, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"


def test_classify_matches_hf_softmax_and_names_the_label(url: str, folders: dict[str, str]) -> None:
    texts = ["great service", DOCS[4], "meh"]
    r = post(url, "/v1/classify", {"model": "classifier", "input": texts})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(folders["classifier"])
    hf = AutoModelForSequenceClassification.from_pretrained(folders["classifier"]).eval()
    for row, text in zip(r.json()["data"], texts, strict=True):
        with torch.inference_mode():
            want = torch.softmax(hf(**tok(text, return_tensors="pt")).logits[0], -1).numpy()
        assert np.abs(np.array(row["probs"]) - want).max() <= TOL
        assert row["label"] == LABELS[int(np.argmax(want))] and row["num_classes"] == 3


def test_a_route_refuses_a_model_of_another_task_and_names_what_is_served(url: str) -> None:
    for path, body in (("/v1/rerank", {"model": "embedder", "query": "q", "documents": ["d"]}),
                       ("/v1/embeddings", {"model": "reranker", "input": "x"}),
                       ("/v1/classify", {"model": "reranker", "input": "x"})):
        r = post(url, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_task" and "'classifier' (classify)" in err["message"]
    r = post(url, "/v1/score", {"model": "nope", "text_1": "a", "text_2": "b"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(url, "/v1/rerank", {"query": "q", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty_input"


def test_a_pair_over_the_limit_is_refused_unless_truncated(url: str) -> None:
    long = "password " * 600
    r = post(url, "/v1/rerank", {"query": QUERY, "documents": ["short", long]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(url, "/v1/rerank", {"query": QUERY, "documents": ["short", long], "truncate": True})
    assert r.status_code == 200 and len(r.json()["results"]) == 2


def _reference(texts: list[str]) -> np.ndarray:
    st = SentenceTransformer(default_model_path(), device="cpu")
    st.max_seq_length = 512  # the model's limit, what the server runs (its folder says 256)
    return np.asarray(st.encode(texts, normalize_embeddings=True), dtype=np.float32)


def test_dimensions_truncate_and_renormalise_and_the_openai_client_passes_them(url: str) -> None:
    texts = ["a short query", DOCS[0], DOCS[4]]
    full = _reference(texts)
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    for dims in (32, 128, 384):
        got = np.array([d.embedding for d in client.embeddings.create(
            model="embedder", input=texts, dimensions=dims).data], dtype=np.float32)
        want = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
        assert got.shape == (3, dims)
        assert np.abs(got - want).max() <= 1e-4
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_quantised_embedding_types_against_a_numpy_reference(url: str) -> None:
    texts = ["a short query", DOCS[2]]
    full = _reference(texts)
    for etype, dtype in (("int8", np.int8), ("uint8", np.uint8), ("binary", np.int8), ("ubinary", np.uint8)):
        as_json = post(url, "/v1/embeddings", {"input": texts, "embedding_type": etype}).json()["data"]
        as_b64 = post(url, "/v1/embeddings", {"input": texts, "embedding_type": etype,
                                               "encoding_format": "base64"}).json()["data"]
        got = np.array([d["embedding"] for d in as_json])
        decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=dtype) for d in as_b64])
        assert np.array_equal(got, decoded.astype(np.int64))
        if etype == "int8":
            want = np.round(np.clip(full, -1, 1) * 127)
        elif etype == "uint8":
            want = np.round((np.clip(full, -1, 1) + 1) * 127.5)
        else:
            bits = np.packbits(full > 0, axis=-1).astype(np.int64)
            want = bits - 128 if etype == "binary" else bits
        assert got.shape == want.shape
        # the server's and the reference's float vectors differ by ~1e-7: a value on a rounding edge
        # (or a coordinate at 0 for the sign bits) may land one step away
        off = np.abs(got - want)
        assert off.max() <= (1 if etype in ("int8", "uint8") else 255) and (off > 0).mean() < 0.01


def test_tokenize_and_detokenize_per_model(url: str, folders: dict[str, str]) -> None:
    tok = AutoTokenizer.from_pretrained(folders["classifier"])
    text = "Hello, tokenizer world!"
    for model in ("embedder", "classifier"):
        r = post(url, "/tokenize", {"model": model, "prompt": text}).json()
        assert r["tokens"] == tok(text)["input_ids"] and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 512
        bare = post(url, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}).json()
        assert bare["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
        back = post(url, "/detokenize", {"model": model, "tokens": bare["tokens"]}).json()
        assert back["prompt"] == tok.decode(bare["tokens"])
    bad = post(url, "/detokenize", {"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_token_id"


def test_the_models_metrics_are_labelled(url: str) -> None:
    text = httpx.get(url + "/metrics").text
    for model in ("embedder", "reranker", "classifier"):
        assert f'batchpilot_queue_length{{model="{model}"}}' in text


def test_the_load_generator_replays_reranks_and_checks_every_document_got_a_result(url: str) -> None:
    from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest, replay

    plan = [PlannedRequest(i, 0.05 * i, 0, 0, {"query": QUERY, "documents": DOCS[: 3 + i]}) for i in range(4)]
    recs = replay(plan, LoadGenConfig(url, endpoint="rerank", progress=False, scrape_interval_s=0)).records
    assert [r.status for r in recs] == [200] * 4 and not any(r.error for r in recs)
