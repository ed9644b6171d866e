"""``batchpilot_llm_rejected_requests_total{reason}`` on the real app (the LLM routes on a free 127.0.0.1
port, in a thread): every refusal the routes answer counts once, under its error code, whatever number
of sequences it had. Engine steps are held by ``StepGate``, so nothing depends on the machine's speed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from inproc import FaultyExecutor, LiveServer, StepGate, engine_held_full, live_server, llm_routes, wait_for

from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.runtime.llm.engine import LLMEngine

REASONS = ("context_length_exceeded", "queue_full", "timeout")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LiveServer, LLMEngine]]:
    # room for 2 running + 1 waiting sequences: a full queue is three held requests
    engine = build_llm_engine(None, num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                              num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=64, block_size=16,
                              max_num_batched_tokens=256, max_model_len=256, max_num_seqs=2,
                              max_waiting_seqs=1, model_name="m", tokenizer_threads=1)
    try:
        with live_server(FaultyExecutor(), engines=[llm_routes(engine, engine.model_name)]) as srv:
            yield srv, engine
    finally:
        engine.shutdown()


def rejected(srv: LiveServer) -> dict[str, float]:
    m = srv.metrics()
    return {r: m[f"batchpilot_llm_rejected_requests_total{{reason={r}}}"] for r in REASONS}


def complete(srv: LiveServer, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": "m", "ignore_eos": True, **body},
                      headers=headers, timeout=30)


def code_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return str(r.json()["error"]["code"])


def idle(engine: LLMEngine) -> None:
    wait_for(lambda: engine.num_pending == 0 and engine.stats().num_running + engine.stats().num_waiting == 0,
             30, "the LLM engine idle")


def test_each_refusal_the_routes_answer_counts_once_by_its_code(
        served: tuple[LiveServer, LLMEngine]) -> None:
    srv, engine = served
    assert rejected(srv) == dict.fromkeys(REASONS, 0.0)  # every reason is exported from the start
    answered = dict.fromkeys(REASONS, 0)

    # 400: 200 prompt tokens + 100 to generate never fit a 256-token context (the engine's admission)
    answered[code_of(complete(srv, prompt=[5] * 200, max_tokens=100), 400)] += 1

    # 503: three held requests fill the engine; the next one is refused before it is tokenised
    with engine_held_full(engine, lambda i: complete(srv, prompt=f"held {i}", max_tokens=2)) as held:
        answered[code_of(complete(srv, prompt="one too many", max_tokens=2), 503)] += 1
    assert [h.status_code for h in held] == [200] * engine.max_admitted
    idle(engine)

    # 504: a request of three prompts whose deadline passes while the engine is held; one request
    gate = StepGate(engine.runner, permits=0)
    try:
        r = complete(srv, {"x-deadline-ms": "300"}, prompt=["a", "b", "c"], max_tokens=50)
        answered[code_of(r, 504)] += 1
    finally:
        gate.remove()
    idle(engine)

    # a stream past its deadline after its first token: the engine expires it (the timeout event)
    gate = StepGate(engine.runner, permits=1)
    try:
        body = {"model": "m", "prompt": "a long stream", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "deadline_ms": 300}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            first_at = time.monotonic()
            wait_for(lambda: time.monotonic() > first_at + 0.3, 10, "the deadline to pass")
            gate.open()  # the engine runs again, now past the deadline
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        answered[events[-1]["error"]["code"]] += 1
    finally:
        gate.remove()
    idle(engine)

    assert answered == {"context_length_exceeded": 1, "queue_full": 1, "timeout": 2}
    seen: list[dict[str, float]] = []
    wait_for(lambda: seen.append(rejected(srv)) or seen[-1] == {k: float(v) for k, v in answered.items()},
             10, lambda: f"the metric to show {answered} (last seen: {seen[-1]})")
