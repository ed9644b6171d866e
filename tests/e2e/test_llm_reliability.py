"""The LLM path under failure and abuse, end to end: the app ``serve --llm`` builds (no-op encoder, small LLM
engine, the engine's liveness in /health) on a free 127.0.0.1 port in a thread, spoken to over real HTTP.

Nothing here depends on the machine's speed: engine steps are held by ``StepGate``, tokenisation by a
tokenizer that waits for the test, and timeouts are tested by holding the work past its deadline.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from inproc import FaultyExecutor, StepGate, engine_held_full, free_port, wait_for

from batchpilot.core.deployment import ServingOptions
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.runtime.llm.engine import LLMEngine, StepRecord
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.llm.routes import make_llm_router
from batchpilot.server.llm.schemas import LLMLimits

HOLD = "HOLD:"  # a prompt starting with this waits in the tokenizer until the test lets it go


class HeldTokenizer:
    """The engine's tokenizer, except that a text starting with ``HOLD`` waits for ``release``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, text: str, **kw: Any) -> Any:
        self.calls += 1
        if text.startswith(HOLD):
            self.entered.set()
            if not self.release.wait(60):
                raise TimeoutError("the test never released the tokenizer")
        return self.inner(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __deepcopy__(self, memo: Any) -> HeldTokenizer:
        return self  # the pool's threads share it: the test holds all of them with one event


def small_engine(**overrides: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                               num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=128, block_size=16,
                               max_num_batched_tokens=256, max_model_len=1024, max_num_seqs=4,
                               max_waiting_seqs=2, model_name="m", tokenizer_threads=2, start=False)
    cfg.update(overrides)
    engine = build_llm_engine(None, **cfg)
    engine.prompts.tokenizer = HeldTokenizer(engine.prompts.tokenizer)
    return engine.start()


@contextmanager
def serving(engine: LLMEngine, limits: LLMLimits | None = None) -> Iterator[str]:
    cfg = ServerConfig(port=free_port(), noop=True, drain_timeout_s=5.0,
                       serving=ServingOptions(request_timeout_s=30.0))
    llm = MountedEngine(lambda reg: make_llm_router(engine, reg, limits), engine.model_name,
                        lambda: engine.is_alive)
    app: Any = create_app(cfg, [ServedModel(FaultyExecutor())], [llm])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "server start")
    try:
        yield f"http://127.0.0.1:{cfg.port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, LLMEngine]]:
    engine = small_engine()
    with serving(engine) as url:
        yield url, engine
    engine.shutdown()


def idle(engine: LLMEngine) -> None:
    wait_for(lambda: (lambda s: s.num_running + s.num_waiting == 0 and s.num_free_blocks == s.num_blocks)(
        engine.stats()) and engine.num_pending == 0, 30, "LLM engine idle, every KV block free")


def complete(url: str, timeout: float = 30, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"max_tokens": 4, "ignore_eos": True, **body},
                      timeout=timeout)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    return err


def sse_events(lines: Iterator[str]) -> list[Any]:
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


# -- a dying engine ------------------------------------------------------------------------------
def test_a_dead_engine_fails_every_request_at_once_and_health_says_so() -> None:
    engine = small_engine()
    armed = threading.Event()

    def observer(rec: StepRecord) -> None:  # as a step log on a full disk would
        if armed.is_set():
            raise OSError("No space left on device")

    engine.step_observers.append(observer)
    gate = StepGate(engine.runner, permits=1)  # the stream's first step, then the engine waits
    try:
        with serving(engine) as url:
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            body = {"model": "m", "prompt": "a stream", "max_tokens": 100, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                first = next(ln for ln in lines if ln.startswith("data: "))
                assert json.loads(first[6:])["choices"]
                waiting: dict[str, httpx.Response] = {}
                t = threading.Thread(target=lambda: waiting.update(r=complete(url, prompt="waits")))
                t.start()
                wait_for(lambda: engine.num_pending == 2, 10, "the second request in the engine")
                armed.set()
                gate.open()  # the next step's observer raises: the loop dies
                rest = sse_events(lines)
            t.join(30)
            assert rest and rest[-1]["error"]["code"] == "engine_stopped"  # an error event, not a cut
            assert "[DONE]" not in rest and "disk" not in json.dumps(rest)
            err = error_of(waiting["r"], 503)  # the request that waited got its answer at once
            assert err["code"] == "engine_stopped" and err["message"] == "the LLM engine is not running"
            assert not engine.is_alive and isinstance(engine.failure, OSError)
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] != "ok"
            assert error_of(complete(url, prompt="after"), 503)["code"] == "engine_stopped"
    finally:
        gate.remove()
        engine.shutdown()


def test_a_failing_step_ends_its_stream_with_an_error_event_and_no_internal_text(
        live: tuple[str, LLMEngine]) -> None:
    url, engine = live
    idle(engine)
    original = engine.runner.forward
    calls = 0

    def forward(chunks: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("secret internal detail")
        return original(chunks)

    engine.runner.forward = forward
    try:
        body = {"model": "m", "prompt": "fails mid-way", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        calls = 0
        plain = complete(url, prompt="fails too", max_tokens=50)  # its third step fails
    finally:
        engine.runner.forward = original
    assert [e for e in events if "choices" in e] and events[-1]["error"]["code"] == "generation_failed"
    assert events[-1]["error"]["message"] == "generation failed" and "secret" not in json.dumps(events)
    assert error_of(plain, 500)["code"] == "generation_failed" and "secret" not in plain.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # one failed step; the engine lives
    idle(engine)


# -- bounds ----------------------------------------------------------------------------------------
def test_a_full_queue_is_503_with_retry_after(live: tuple[str, LLMEngine]) -> None:
    url, engine = live
    idle(engine)
    with engine_held_full(engine, lambda i: complete(url, prompt=f"held {i}")) as held:
        r = complete(url, prompt="one too many")
        err = error_of(r, 503)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    assert [h.status_code for h in held] == [200] * engine.max_admitted
    idle(engine)


def test_a_request_past_its_deadline_is_504_and_its_sequence_freed(live: tuple[str, LLMEngine]) -> None:
    url, engine = live
    idle(engine)
    gate = StepGate(engine.runner, permits=0)  # it cannot finish: the deadline passes first
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "slow", "max_tokens": 50},
                       headers={"x-deadline-ms": "200"}, timeout=30)
        err = error_of(r, 504)
        assert err["code"] == "timeout"
        assert err["message"] == "the request was not answered within its time limit"
    finally:
        gate.remove()
    idle(engine)  # aborted: no sequence left, every block free


def test_a_stream_past_its_deadline_ends_with_a_timeout_event(live: tuple[str, LLMEngine]) -> None:
    url, engine = live
    idle(engine)
    before = engine.stats().num_timed_out
    gate = StepGate(engine.runner, permits=1)
    deadline_s = 0.3
    try:
        body = {"model": "m", "prompt": "a long stream", "max_tokens": 500, "ignore_eos": True,
                "stream": True, "deadline_ms": deadline_s * 1000}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            first_at = time.monotonic()
            wait_for(lambda: time.monotonic() > first_at + deadline_s, 10, "the deadline to pass")
            gate.open()  # the engine runs again, now past the deadline
            events = sse_events(lines)
    finally:
        gate.remove()
    assert events[-1]["error"]["code"] == "timeout" and len(events) < 500
    idle(engine)
    assert engine.stats().num_timed_out == before + 1


# -- limits, checked before tokenising ---------------------------------------------------------------
LIMIT_CASES = [  # every limit, one by one: tests/test_llm_schemas.py
    ("too many prompts", "/v1/completions", {"prompt": ["p"] * 65}, "too_many_prompts", "prompt"),
    ("prompt too long", "/v1/completions", {"prompt": "x" * ((1 << 20) + 1)}, "prompt_too_long", "prompt"),
    ("stop too long", "/v1/completions", {"prompt": "p", "stop": ["s" * 257]}, "stop_too_long", "stop"),
    ("too many messages", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 513},
     "too_many_messages", "messages"),
]


@pytest.mark.parametrize(("path", "body", "code", "param"),
                         [pytest.param(*c[1:], id=c[0]) for c in LIMIT_CASES])
def test_oversized_requests_are_400_before_any_tokenising(
        live: tuple[str, LLMEngine], path: str, body: dict[str, Any], code: str, param: str) -> None:
    url, engine = live
    tokenizer = engine.prompts.tokenizer
    calls = tokenizer.calls
    err = error_of(httpx.post(url + path, json={"model": "m", **body}, timeout=30), 400)
    assert (err["code"], err["param"]) == (code, param)
    assert tokenizer.calls == calls


# -- tokenising off the event loop -------------------------------------------------------------------
def test_health_and_other_streams_answer_while_a_huge_prompt_is_tokenised(
        live: tuple[str, LLMEngine]) -> None:
    url, engine = live
    idle(engine)
    tokenizer = engine.prompts.tokenizer
    tokenizer.entered.clear()
    tokenizer.release.clear()
    big: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: big.update(r=complete(url, prompt=HOLD + "many words " * 80_000)))
    t.start()
    try:
        assert tokenizer.entered.wait(30), "the huge prompt never reached the tokenizer"
        health = httpx.get(url + "/health", timeout=10)  # the event loop is free: answered
        other = complete(url, prompt="meanwhile", max_tokens=3, timeout=20)
        still_held = not tokenizer.release.is_set() and t.is_alive()
    finally:
        tokenizer.release.set()
        t.join(60)
    assert health.status_code == 200 and other.status_code == 200 and still_held
    assert big["r"].status_code == 400  # far over the context: refused after tokenising, not before
    idle(engine)
