"""The LLM failover end to end: the app ``serve --llm`` builds, with the continuous-batching engine behind
``LLMFailover`` (watchdog, circuit breaker, static-batching fallback on the same weights), on a free
127.0.0.1 port in a thread, spoken to over real HTTP.

Faults are real: a runner whose step raises ``torch.OutOfMemoryError``, a step observer that raises
(the engine loop dies), a step held on a gate past the stall bound. Steps and probes are held by
gates, so the tests see the server while it is failed over and decide when it may recover; every
wait is bounded polling of a state the server reaches (``wait_for``), never a timing assertion.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import torch
import uvicorn
from inproc import FaultyExecutor, StepGate, free_port, scrape, wait_for

from batchpilot.core.breaker import BreakerConfig
from batchpilot.core.deployment import ServingOptions
from batchpilot.core.stall import StallRule
from batchpilot.runtime.llm.build import build_fallback, build_llm_engine
from batchpilot.runtime.llm.engine import LLMEngine, StepRecord
from batchpilot.runtime.llm.failover import LLMFailover
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.llm.routes import make_llm_router

UP, ACTIVE = "batchpilot_engine_up{engine=llm}", "batchpilot_engine_fallback_active{engine=llm}"
PROMPTS = ["the quick brown fox", "def f(x):", "a", "hello world, hello"]


def small_engine() -> LLMEngine:
    # initializer_range 0.06: well-separated logits, so greedy parity holds across batch shapes
    return build_llm_engine(None, num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                            num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=128, block_size=16,
                            max_num_batched_tokens=256, max_model_len=512, max_num_seqs=4, max_waiting_seqs=8,
                            model_name="m", tokenizer_threads=2, initializer_range=0.06)


@contextmanager
def serving(fallback: bool = True, stall_s: float = 60.0) -> Iterator[tuple[str, LLMFailover]]:
    engine = small_engine()
    failover = LLMFailover(engine, build_fallback(engine, max_batch_size=4) if fallback else None,
                           StallRule(timeout_s=stall_s), BreakerConfig(probe_interval_s=0.05, backoff=1.0))
    cfg = ServerConfig(port=free_port(), noop=True, drain_timeout_s=5.0,
                       serving=ServingOptions(request_timeout_s=60.0))
    llm = MountedEngine(lambda reg: make_llm_router(failover, reg), "m", lambda: failover.is_alive)
    app: Any = create_app(cfg, [ServedModel(FaultyExecutor())], [llm])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "server start")
    try:
        yield f"http://127.0.0.1:{cfg.port}", failover
    finally:
        server.should_exit = True
        thread.join(15)
        failover.shutdown(5.0)


def complete(url: str, prompt: str, **body: Any) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def in_threads(url: str, prompts: list[str]) -> list[httpx.Response]:
    """One request per prompt, all at once; every request's answer, in prompt order."""
    answers: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: answers.update({i: complete(url, p)}))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [answers[i] for i in range(len(prompts))]


def health(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).status_code


def failover_metrics(url: str) -> dict[str, float]:
    m = scrape(url)
    return {k: v for k, v in m.items() if k.startswith(("batchpilot_engine", "batchpilot_fallback"))}


def sse_events(lines: Iterator[str]) -> list[Any]:
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


class OomOnce:
    """The runner's forward, raising out-of-memory on call ``at``; later calls wait for ``resume``."""

    def __init__(self, runner: Any, at: int) -> None:
        self.runner, self.original, self.at, self.calls = runner, runner.forward, at, 0
        self.resume = threading.Event()
        runner.forward = self.forward

    def forward(self, chunks: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        if self.calls > self.at and not self.resume.wait(30):
            raise TimeoutError("the test never resumed the runner")
        return self.original(chunks)


def test_an_out_of_memory_step_moves_its_requests_to_the_fallback_with_the_same_greedy_text() -> None:
    with serving() as (url, failover):
        reference = [r.json()["choices"][0]["text"] for r in in_threads(url, PROMPTS)]  # the main engine
        assert failover.fallback_requests == 0
        m = failover_metrics(url)
        assert m[UP] == 1 and m[ACTIVE] == 0
        oom = OomOnce(failover.main.runner, at=1)  # the next step runs out of memory
        try:
            answers = in_threads(url, PROMPTS)
            assert [r.status_code for r in answers] == [200] * len(PROMPTS)  # every request answered, once
            assert [r.json()["choices"][0]["text"] for r in answers] == reference  # greedy parity
            assert failover.fallback_requests == len(PROMPTS)
            assert health(url) == 503  # the probe waits on the runner: still failed over
            m = failover_metrics(url)
            assert m['batchpilot_engine_faults_total{engine=llm,kind=oom}'] == 1
            assert m[UP] == 0
            assert m[ACTIVE] == 1
            assert m['batchpilot_fallback_requests_total{engine=llm}'] == len(PROMPTS)
            during = complete(url, "sent while failed over")  # new requests go straight to the fallback
            assert during.status_code == 200 and failover.fallback_requests == len(PROMPTS) + 1
        finally:
            oom.resume.set()  # the probe's step runs: the engine comes back
        wait_for(lambda: health(url) == 200, 30, "the engine back after the probe")
        m = failover_metrics(url)
        assert m['batchpilot_engine_recoveries_total{engine=llm}'] == 1
        assert m[UP] == 1 and m[ACTIVE] == 0
        after = in_threads(url, PROMPTS)
        assert [r.json()["choices"][0]["text"] for r in after] == reference
        assert failover.fallback_requests == len(PROMPTS) + 1  # served by the main engine again
        answered = sum(v for k, v in scrape(url).items() if k.startswith("batchpilot_llm_requests_total"))
        assert answered == 3 * len(PROMPTS) + 1  # every request finished exactly once


def test_a_dead_engine_thread_ends_open_streams_with_an_error_event_and_the_waiting_go_to_fallback() -> None:
    with serving() as (url, failover):
        armed = threading.Event()

        def observer(rec: StepRecord) -> None:  # as a step log on a full disk would, once
            if armed.is_set():
                armed.clear()
                raise OSError("No space left on device")

        failover.step_observers.append(observer)
        gate = StepGate(failover.main.runner, permits=1)  # the stream's first step, then the engine waits
        try:
            body = {"model": "m", "prompt": "a stream", "max_tokens": 50, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
                lines = stream.iter_lines()
                assert json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])["choices"]
                waiting: dict[str, httpx.Response] = {}
                t = threading.Thread(target=lambda: waiting.update(r=complete(url, "waits")))
                t.start()
                wait_for(lambda: failover.main.num_pending == 2, 10, "the second request in the engine")
                armed.set()
                gate.allow(1)  # the next step's observer raises: the loop dies; the gate holds the probe
                rest = sse_events(lines)
            t.join(60)
            assert rest[-1]["error"]["code"] == "engine_unavailable" and "[DONE]" not in rest
            assert "disk" not in json.dumps(rest)
            assert waiting["r"].status_code == 200 and waiting["r"].json()["choices"][0]["text"]
            assert health(url) == 503
            m = failover_metrics(url)
            assert m['batchpilot_engine_faults_total{engine=llm,kind=died}'] == 1
            assert m[ACTIVE] == 1
            assert complete(url, "during").status_code == 200
        finally:
            gate.open()
        wait_for(lambda: health(url) == 200, 30, "the engine back after the probe")
        assert failover_metrics(url)['batchpilot_engine_recoveries_total{engine=llm}'] == 1
        gate.remove()
        assert complete(url, "after").status_code == 200


def test_a_stalled_step_turns_health_503_and_the_engine_returns_only_after_the_step_does() -> None:
    with serving(stall_s=2.0) as (url, failover):
        stuck = failover.main
        gate = StepGate(stuck.runner, permits=1)
        try:
            body = {"model": "m", "prompt": "a stream", "max_tokens": 50, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
                lines = stream.iter_lines()
                next(ln for ln in lines if ln.startswith("data: "))  # its second step never ends
                waiting = complete(url, "waits behind the stuck step")  # answered by the fallback
                rest = sse_events(lines)
            assert waiting.status_code == 200
            assert rest[-1]["error"]["code"] == "engine_unavailable"  # an error event, not a hang
            assert health(url) == 503
            m = failover_metrics(url)
            assert m['batchpilot_engine_faults_total{engine=llm,kind=stalled}'] == 1
            assert m['batchpilot_engine_stall_timeout_seconds{engine=llm}'] == 2.0
            assert stuck.busy_since is not None and failover.main is stuck  # no second thread on the runner
            assert health(url) == 503
        finally:
            gate.open()  # the step returns; the old thread ends; the next probe builds a new engine
        wait_for(lambda: health(url) == 200, 30, "the engine back after the stuck step returned")
        gate.remove()
        assert failover.main is not stuck and complete(url, "after").status_code == 200


def test_without_a_fallback_the_waiting_and_new_requests_get_503_engine_unavailable() -> None:
    with serving(fallback=False) as (url, failover):
        oom = OomOnce(failover.main.runner, at=1)
        try:
            r = complete(url, "fails")
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "engine_unavailable" and {"message", "type", "param"} <= set(err)
            assert "simulated" not in r.text
            assert complete(url, "new").json()["error"]["code"] == "engine_unavailable"
            assert health(url) == 503
            assert failover_metrics(url)[ACTIVE] == 0
        finally:
            oom.resume.set()
        wait_for(lambda: health(url) == 200, 30, "the engine back after the probe")
        assert complete(url, "after").status_code == 200


def test_serve_llm_puts_the_engine_behind_its_watchdog_and_fallback(tmp_path: Any) -> None:
    from conftest import running_server

    args = ["--noop", "--no-warmup", "--llm", "--num-kv-blocks", "64", "--max-num-seqs", "4",
            "--threads", "1"]
    with running_server(args, tmp_path) as url:
        m = failover_metrics(url)
        assert m[UP] == 1 and m[ACTIVE] == 0 and m["batchpilot_fallback_requests_total{engine=llm}"] == 0
        assert m["batchpilot_engine_stall_timeout_seconds{engine=llm}"] == StallRule().cold_s  # measured
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and health(url) == 200
