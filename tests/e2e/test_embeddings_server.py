"""The real server (subprocess, real MiniLM, free port) called with the official openai client and httpx.

Parity: every embedding equals sentence-transformers' (max_seq_length 512, normalised) to cosine
>= 0.99999 whatever shared its batch — concurrent requests of mixed lengths make the server batch them.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import time
from typing import Any

import httpx
import numpy as np
import pytest
from inproc import scrape
from openai import AsyncOpenAI, OpenAI

from batchpilot.models.encoder import default_model_path

LENGTHS = [5, 12, 40, 77, 130, 260, 511]


@pytest.fixture(scope="module")
def st_model() -> Any:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 512
    return model


@pytest.fixture(scope="module")
def texts(st_model: Any) -> list[str]:
    from batchpilot.models.texts import texts_for_lengths

    return texts_for_lengths(st_model.tokenizer, LENGTHS, seed=3)


def model_name(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["id"])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    return scrape(url, headers)


def test_openai_client_concurrent_mixed_lengths_match_sentence_transformers(
        server_url: str, texts: list[str], st_model: Any) -> None:
    name = model_name(server_url)
    client = AsyncOpenAI(base_url=server_url + "/v1", api_key="unused")

    async def one(text: str) -> list[float]:
        resp = await client.embeddings.create(model=name, input=text)  # default encoding: base64
        return resp.data[0].embedding

    async def all_at_once() -> list[list[float]]:
        return list(await asyncio.gather(*(one(t) for t in texts * 2)))

    got = np.array(asyncio.run(all_at_once()), dtype=np.float32)
    want = st_model.encode(texts * 2, normalize_embeddings=True)
    assert got.shape == want.shape == (len(texts) * 2, 384)
    assert cosines(got, want).min() >= 0.99999
    m = metrics(server_url)
    assert m["batchpilot_batch_size_sum"] >= len(texts) * 2
    assert m["batchpilot_batch_size_count"] < m["batchpilot_batch_size_sum"]  # some batches held several


def test_openai_client_float_format_list_input_and_usage(server_url: str, texts: list[str],
                                                          st_model: Any) -> None:
    client = OpenAI(base_url=server_url + "/v1", api_key="unused")
    resp = client.embeddings.create(model=model_name(server_url), input=texts, encoding_format="float")
    assert [d.index for d in resp.data] == list(range(len(texts)))
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert cosines(got, st_model.encode(texts, normalize_embeddings=True)).min() >= 0.99999
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(LENGTHS)
    assert resp.model == model_name(server_url)


def test_token_id_inputs_embed_like_their_text(server_url: str, texts: list[str], st_model: Any) -> None:
    tok = st_model.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:3]]
    one = httpx.post(server_url + "/v1/embeddings", json={"input": ids[0]}).json()
    many = httpx.post(server_url + "/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()
    vec_one = np.array(one["data"][0]["embedding"], dtype=np.float32)[None]
    vec_many = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in many["data"]])
    want = st_model.encode(texts[:3], normalize_embeddings=True)
    assert cosines(vec_one, want[:1]).min() >= 0.99999
    assert cosines(vec_many, want).min() >= 0.99999
    assert many["usage"]["prompt_tokens"] == sum(LENGTHS[:3])


def test_base64_carries_exactly_the_float_answer_and_server_timing_splits_the_stages(
        server_url: str, texts: list[str]) -> None:
    from batchpilot.bench.loadgen import parse_server_timing

    body = {"input": texts[:2]}
    as_float = httpx.post(server_url + "/v1/embeddings", json={**body, "encoding_format": "float"})
    as_b64 = httpx.post(server_url + "/v1/embeddings", json={**body, "encoding_format": "base64"})
    assert as_float.headers["content-type"] == "application/json"
    floats = np.array([d["embedding"] for d in as_float.json()["data"]], dtype=np.float32)
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                        for d in as_b64.json()["data"]])
    np.testing.assert_array_equal(floats, decoded)  # float32 both ways, bit for bit
    st = parse_server_timing(as_b64.headers["server-timing"])
    assert set(st) == {"tokenize", "batcher", "queue", "prepare", "run", "encode", "app"}
    assert all(v >= 0 for v in st.values())
    ulp = 4e-6  # each value is rounded to the microsecond: a sum of three may exceed its total by 1.5 us
    assert st["queue"] + st["prepare"] + st["run"] <= st["batcher"] + ulp
    assert st["tokenize"] + st["batcher"] + st["encode"] <= st["app"] + ulp


def test_too_long_is_400_unless_truncation_is_asked(server_url: str, st_model: Any) -> None:
    long_text = " ".join(["serving"] * 700)
    r = httpx.post(server_url + "/v1/embeddings", json={"input": long_text})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]
    r = httpx.post(server_url + "/v1/embeddings", json={"input": long_text, "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 512
    got = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)[None]
    assert cosines(got, st_model.encode([long_text], normalize_embeddings=True)).min() >= 0.99999


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"input": []}, 400, "empty_input"),
    ({"input": ""}, 400, "empty_input"),
    ({"input": ["ok", ""]}, 400, "empty_input"),
    ({"input": [[]]}, 400, "empty_input"),
    ({"input": 5}, 422, "invalid_value"),
    ({"input": [1, "a"]}, 422, "invalid_value"),
    ({"input": [[1], "a"]}, 422, "invalid_value"),
    ({"input": [True]}, 422, "invalid_value"),
    ({}, 422, "invalid_value"),
    ({"input": "hi", "encoding_format": "hex"}, 422, "invalid_value"),
    ({"input": "hi", "model": "no-such-model"}, 404, "model_not_found"),
    ({"input": "hi", "dimensions": 385}, 400, "unsupported_dimensions"),  # over the model's 384
    ({"input": "hi", "dimensions": 0}, 422, "invalid_value"),
    ({"input": "hi", "embedding_type": "int4"}, 422, "invalid_value"),
    ({"input": [[999999]]}, 400, "invalid_token_id"),  # id outside the vocabulary
])
def test_bad_requests_get_openai_errors(server_url: str, body: dict[str, Any], status: int,
                                        code: str) -> None:
    r = httpx.post(server_url + "/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]


def test_malformed_json_is_422_not_500(server_url: str) -> None:
    r = httpx.post(server_url + "/v1/embeddings", content=b'{"input": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and "error" in r.json()


def test_infeasible_deadline_is_429_with_the_reason_by_body_or_header(server_url: str) -> None:
    before = metrics(server_url).get("batchpilot_rejections_total{reason=infeasible_deadline}", 0.0)
    r = httpx.post(server_url + "/v1/embeddings", json={"input": "a short text", "deadline_ms": 0.01})
    assert r.status_code == 429 and r.json()["error"]["code"] == "infeasible_deadline"
    r = httpx.post(server_url + "/v1/embeddings", json={"input": "a short text"},
                   headers={"X-Deadline-Ms": "0.01"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "infeasible_deadline"
    assert metrics(server_url)["batchpilot_rejections_total{reason=infeasible_deadline}"] == before + 2
    ok = httpx.post(server_url + "/v1/embeddings", json={"input": "a short text"},
                    headers={"X-Deadline-Ms": "30000", "X-Priority": "-1"})
    assert ok.status_code == 200
    bad = httpx.post(server_url + "/v1/embeddings", json={"input": "x"}, headers={"X-Priority": "high"})
    assert bad.status_code == 400


def test_health_models_and_metrics(server_url: str) -> None:
    h = httpx.get(server_url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    models = httpx.get(server_url + "/v1/models").json()
    assert models["data"][0]["dimensions"] == 384 and models["data"][0]["max_model_len"] == 512
    httpx.post(server_url + "/v1/embeddings", json={"input": ["one", "two words", "three more words"]})
    m = metrics(server_url)
    for name in ("batchpilot_queue_length", "batchpilot_pending_requests",
                 "batchpilot_queue_time_seconds_count", "batchpilot_request_latency_seconds_count",
                 "batchpilot_executor_utilization",
                 "batchpilot_padding_efficiency", "batchpilot_health"):
        assert name in m, name
    assert 0 < m["batchpilot_useful_tokens_total"] <= m["batchpilot_computed_tokens_total"]
    assert 0 < m["batchpilot_padding_efficiency"] <= 1 and 0 < m["batchpilot_executor_utilization"] <= 1
    assert m["batchpilot_http_requests_total{route=/v1/embeddings,status=200}"] >= 1
    assert m["batchpilot_queue_length"] == 0 and m["batchpilot_health"] == 1.0


# -- the guarded no-op server: API key, body limit, overload, disconnects -------------------------
def test_api_key_is_required_everywhere_but_health(guarded_url: str) -> None:
    assert httpx.get(guarded_url + "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/embeddings")):
        r = httpx.request(method, guarded_url + path, json={"input": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.request(method, guarded_url + path, json={"input": "x"},
                              headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
    client = OpenAI(base_url=guarded_url + "/v1", api_key="e2e-secret")
    assert len(client.embeddings.create(model="noop", input="hello there").data[0].embedding) == 384


def test_body_over_the_limit_is_413(guarded_url: str, auth: dict[str, str]) -> None:
    r = httpx.post(guarded_url + "/v1/embeddings", json={"input": "x" * 70_000}, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Any:  # no Content-Length: the guard counts the streamed body
        for _ in range(40):
            yield b" " * 2048

    r = httpx.post(guarded_url + "/v1/embeddings", content=chunks(), headers=auth)
    assert r.status_code == 413


def test_overload_gets_503_with_retry_after_and_every_request_one_answer(guarded_url: str,
                                                                        auth: dict[str, str]) -> None:
    def post(i: int) -> httpx.Response:
        return httpx.post(guarded_url + "/v1/embeddings", json={"input": f"request {i}"}, headers=auth,
                          timeout=30)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(post, range(12)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(200) >= 1 and codes.count(503) >= 1, codes
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1


def test_client_that_disconnects_while_queued_is_never_executed(guarded_url: str,
                                                                auth: dict[str, str]) -> None:
    def m() -> dict[str, float]:
        return metrics(guarded_url, auth)

    def cancelled(v: dict[str, float]) -> float:
        return sum(val for k, val in v.items() if k.startswith("batchpilot_cancellations_total"))

    def post(text: str, timeout: float = 30) -> httpx.Response:
        return httpx.post(guarded_url + "/v1/embeddings", json={"input": text}, headers=auth, timeout=timeout)

    before = m()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # two requests hold the model for 2 x 400 ms; "gives up" queues behind both
        busy = [pool.submit(post, "occupies the model"), pool.submit(post, "and keeps it busy")]
        deadline = time.monotonic() + 10
        while m()["batchpilot_pending_requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):
            post("gives up", timeout=0.05)
        assert [b.result().status_code for b in busy] == [200, 200]
    assert post("after").status_code == 200  # FIFO: anything still queued before it has run by now
    after = m()
    runs = after["batchpilot_batch_run_seconds_count"] - before["batchpilot_batch_run_seconds_count"]
    assert runs == 3  # the two busy ones and "after": the cancelled one never reached the model
    assert cancelled(after) == cancelled(before) + 1
    assert after["batchpilot_queue_length"] == 0 and after["batchpilot_pending_requests"] == 0
