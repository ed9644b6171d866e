"""The LLM routes end to end: a real uvicorn server on a free 127.0.0.1 port, real openai/httpx clients.

The app here is built by hand (FastAPI + error handlers + the LLM router) so this test depends only on
on the LLM routes and engine; ``batchpilot serve --llm`` mounts the same router.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.runtime.llm.engine import LLMEngine
from batchpilot.server.errors import install_error_handlers
from batchpilot.server.llm.routes import make_llm_router


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, LLMEngine, CollectorRegistry]]:
    # a 2-layer, 256-wide cut of the default tiny Llama keeps the test fast; same code paths
    engine = build_llm_engine(None, num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                              num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=128, block_size=16,
                              max_num_batched_tokens=256, max_model_len=1024, model_name="m")
    registry = CollectorRegistry()
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(make_llm_router(engine, registry))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine, registry
    srv.should_exit = True
    thread.join(10)
    engine.shutdown()


@pytest.fixture
def client(server: tuple[str, LLMEngine, CollectorRegistry]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_completion_greedy_is_deterministic_with_usage(client: openai.OpenAI) -> None:
    a = client.completions.create(model="m", prompt="The library", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model="m", prompt="The library", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage is not None and a.usage.completion_tokens == 8 and a.usage.prompt_tokens >= 2


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model="m", prompt="import os", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    stream = client.completions.create(model="m", prompt="import os", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_stream_headers_split_the_first_token_time(server: tuple[str, LLMEngine, CollectorRegistry]) -> None:
    """Server-Timing on a stream: prompt encoding, the engine's TTFT, and the handler's whole first-token
    time, nested (what the fidelity check reads to tell HTTP from the engine)."""
    from batchpilot.bench.loadgen import parse_server_timing

    body = {"model": "m", "prompt": "timing", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        t = parse_server_timing(r.headers["server-timing"])
        assert r.read().endswith(b"data: [DONE]\n\n")
    assert set(t) == {"tokenize", "engine", "app"}
    assert t["engine"] > 0 and t["tokenize"] >= 0
    assert t["tokenize"] + t["engine"] <= t["app"] + 2e-6  # each printed to the microsecond


def test_load_generator_counts_every_streamed_token(server: tuple[str, LLMEngine, CollectorRegistry]) -> None:
    """The load generator against the real engine: every token of ``max_tokens`` (ignore_eos) is counted,
    text or not (the random model streams tokens whose text the detokenizer holds back), and its
    records carry the server's first-token split."""
    import numpy as np

    from batchpilot.bench.loadgen import LoadGenConfig, build_plan, replay
    from batchpilot.sim.traces import Workload

    wl = Workload.from_columns("t", np.array([0.0, 0.01, 0.02]), np.array([7, 30, 12]), np.array([9, 4, 12]))
    cfg = LoadGenConfig(server[0], "completions", model="m", progress=False, scrape_interval_s=0)
    res = replay(build_plan(wl, "completions"), cfg)
    for r, want in zip(res.records, [9, 4, 12], strict=True):
        assert r.ok and r.tokens_received == want and len(r.itl_s) == want - 1
        assert 0 < r.server_batcher_s <= r.server_app_s <= r.ttft_s <= r.latency_s


def test_chat_completion_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    kw = {"model": "m", "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    resp = client.chat.completions.create(messages=messages, **kw)  # type: ignore[call-overload]
    assert resp.choices[0].message.role == "assistant" and resp.usage is not None
    assert resp.usage.completion_tokens == 6
    stream = client.chat.completions.create(messages=messages, stream=True, **kw)  # type: ignore[call-overload]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kw = {"model": "m", "prompt": "Hello", "max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 7,
          "extra_body": {"ignore_eos": True, "top_k": 50}}
    first = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    assert first == client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]


def test_stop_string_truncates_output(client: openai.OpenAI) -> None:
    base = client.completions.create(model="m", prompt="A", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:6]
    assert stop, "the greedy output is too short to pick a stop string"
    out = client.completions.create(model="m", prompt="A", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and out.text == base[: base.find(stop)]


Server = tuple[str, LLMEngine, CollectorRegistry]


def test_errors_are_openai_shaped(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=5000)
    assert "context length" in str(err.value)
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": [], "model": "m"})
    assert r.status_code == 422 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "x", "n": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": [5, 99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "x", "seed": 2**70})
    assert r.status_code == 422


def test_concurrent_requests_batch_and_cancelled_stream_frees_blocks(
        server: tuple[str, LLMEngine, CollectorRegistry]) -> None:
    url, engine, registry = server

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            # a stream the client abandons after two events
            async with http.stream("POST", "/v1/completions", json={
                    "prompt": "long", "max_tokens": 500, "stream": True, "ignore_eos": True}) as resp:
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data:")
                    if n == 2:
                        break
            bodies = await asyncio.gather(*[http.post("/v1/completions", json={
                "prompt": f"prompt {i}", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
                for i in range(6)])
            return [b.json()["choices"][0]["text"] for b in bodies]

    before = engine.stats().num_generated_tokens
    texts = asyncio.run(run())
    assert len(texts) == 6
    deadline = time.monotonic() + 20
    while engine.stats().num_free_blocks != engine.stats().num_blocks or engine.stats().num_running:
        assert time.monotonic() < deadline, f"blocks leaked: {engine.stats()}"
        time.sleep(0.05)
    # the abandoned 500-token stream was aborted, not run to its end
    assert engine.stats().num_generated_tokens - before < 500
    metrics = generate_latest(registry).decode()
    for name in ("running_seqs", "waiting_seqs", "kv_blocks_used", "kv_blocks_free", "preemptions_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "kv_fragmentation_ratio", "generation_tokens_per_second"):
        assert f"batchpilot_llm_{name}" in metrics
    assert engine.stats().num_steps > 0


def test_step_counters(server: tuple[str, LLMEngine, CollectorRegistry]) -> None:
    """The engine times its steps (wall, and the forward + sampling part) and sums their features."""
    url, engine, _ = server
    before = engine.stats()

    async def streams() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "m", "prompt": [7 + i] * (6 + 4 * i), "max_tokens": 12, "ignore_eos": True})
                for i in range(3)))

    asyncio.run(streams())
    _idle(engine)  # the stats are a snapshot taken after each step: read them once the last is counted
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    assert steps >= 12 and after.step_seqs - before.step_seqs >= steps  # >= 1 sequence per step
    assert 0 < after.forward_seconds - before.forward_seconds < after.step_seconds - before.step_seconds
    feats = {k: after.step_features[k] - before.step_features.get(k, 0.0) for k in after.step_features}
    assert feats["const"] == steps and feats["decode_seqs"] + feats["prefill_tokens"] >= steps
    assert feats["multi_row"] <= steps


def test_step_log_records_every_step_with_its_shape(server: tuple[str, LLMEngine, CollectorRegistry],
                                                    tmp_path: Path) -> None:
    """``serve --llm-step-log``: one line per engine step, its features summing to the engine's own
    counters."""
    from batchpilot.runtime.llm.engine import StepLog

    url, engine, _ = server
    _idle(engine)
    while not engine._idled:  # the first logged step then follows an idle wait
        time.sleep(0.01)
    log = StepLog(str(tmp_path / "steps.jsonl"))
    before = engine.stats()
    engine.step_observers.append(log)
    try:
        async def streams() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                await asyncio.gather(*(http.post("/v1/completions", json={
                    "model": "m", "prompt": [5 + i] * (8 + 8 * i), "max_tokens": 10, "ignore_eos": True})
                    for i in range(3)))
        asyncio.run(streams())
        _idle(engine)  # the last step's record is written after its tokens are delivered
    finally:
        engine.step_observers.remove(log)
        log.close()
    after = engine.stats()
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == after.num_steps - before.num_steps >= 10
    assert steps[0]["after_idle"]
    for name in ("const", "prefill_tokens", "decode_seqs", "multi_row"):
        logged = sum(s["features"].get(name, 0.0) for s in steps)
        assert logged == pytest.approx(after.step_features[name] - before.step_features.get(name, 0.0))
    assert all(0 < s["forward_s"] <= s["wall_s"] for s in steps if s["seqs"])
    for a, b in zip(steps, steps[1:], strict=False):
        assert b["start"] >= a["start"] + a["wall_s"]  # steps never overlap: one engine thread


def _idle(engine: LLMEngine) -> None:
    deadline = time.monotonic() + 30
    while (lambda s: s.num_running + s.num_waiting or s.num_free_blocks != s.num_blocks)(engine.stats()):
        assert time.monotonic() < deadline, f"engine not idle: {engine.stats()}"
        time.sleep(0.02)


def test_a_refused_later_prompt_starts_none_of_the_request(server: Server) -> None:
    url, engine, _ = server
    _idle(engine)
    before = engine.stats()
    r = httpx.post(url + "/v1/completions", json={"prompt": ["fits", "word " * 2000], "max_tokens": 200,
                                                  "ignore_eos": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    _idle(engine)
    after = engine.stats()
    assert (after.num_generated_tokens, after.num_steps) == (before.num_generated_tokens, before.num_steps)


def test_the_prompts_of_one_request_enter_the_engine_together(server: Server) -> None:
    url, engine, _ = server
    _idle(engine)
    steps: list[int] = []
    engine.step_observers.append(obs := lambda rec: steps.append(rec.num_seqs))
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": ["one", "two", "three"], "max_tokens": 3},
                       timeout=30)
    finally:
        engine.step_observers.remove(obs)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert steps[0] == 3  # all three prefilled in the first step


@pytest.mark.parametrize(("route", "field", "value"), [
    ("/v1/completions", "functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/completions", "echo", True),
])
def test_a_field_that_would_change_the_answer_is_refused_not_dropped(server: Server, route: str, field: str,
                                                                   value: Any) -> None:
    """The OpenAI client sends these; a server that dropped them would answer something else than asked."""
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    if field == "tool_choice" and route != "/v1/completions":
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]  # type: ignore[list-item]
    r = httpx.post(server[0] + route, json={**body, "model": "m", "max_tokens": 2, field: value})
    assert r.status_code == 400, (route, field, r.text)
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (field, "unsupported_value") and field in err["message"]


def test_the_values_that_change_nothing_are_accepted(server: Server) -> None:
    body = {"prompt": "x", "model": "m", "max_tokens": 2, "response_format": {"type": "text"},
            "tool_choice": "none", "logit_bias": {}, "repetition_penalty": 1, "min_tokens": 0, "priority": 0}
    assert httpx.post(server[0] + "/v1/completions", json=body).status_code == 200


def test_a_priority_sent_to_an_fcfs_engine_is_refused_with_the_flag_that_honours_it(server: Server) -> None:
    assert server[1].config.policy == "fcfs"
    for kw in ({"json": {"prompt": "x", "max_tokens": 2, "priority": 3}},
               {"json": {"prompt": "x", "max_tokens": 2}, "headers": {"X-Priority": "-2"}}):
        r = httpx.post(server[0] + "/v1/completions", **kw)  # type: ignore[arg-type]
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
