"""Priorities and aging over HTTP, with the official ``openai`` client against the app ``serve --llm`` builds.

Each engine is built the way ``serve --llm --config`` builds it (the config file's deployment through
``build_llm_engine(model, spec)``) with ``policy: priority`` and one sequence at a time, so the order in
which requests get their first token is the scheduler's order and nothing else. Engine steps are held by
a gate while the requests arrive; the order is read from the engine's token events, not from wall-clock
timings. The only wall-clock wait is the aging test's: it waits until a request has queued past the
(short) aging bound, a wait that a slow machine only lengthens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from inproc import FaultyExecutor, StepGate, live_server, llm_routes, wait_for

from batchpilot.core.deployment import ServingOptions
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.runtime.llm.engine import LLMEngine, TokenEvent
from batchpilot.settings import load_spec

URGENT, LOW = -10, 10
AGING_S = 0.5  # the aging engine's max_priority_wait_s
TINY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
            num_key_value_heads=2, model_name="m", tokenizer_threads=1)


class WatchedGate(StepGate):
    """A ``StepGate`` that says when the engine has reached a step and is held there."""

    def __init__(self, runner: Any, permits: int = 0) -> None:
        self.entered = threading.Event()
        super().__init__(runner, permits)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        return super().forward(*args, **kwargs)


@dataclass
class Served:
    """A server over one engine; every ``engine.submit`` the routes make is recorded (priority, seq ids),
    and every first token (seq id, in the order the engine produced them)."""

    url: str
    engine: LLMEngine
    submitted: list[tuple[int, list[int]]] = field(default_factory=list)
    first_tokens: list[int] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def reset(self) -> None:
        wait_for(lambda: self.engine.num_pending == 0, 30, "the engine idle")
        self.submitted.clear()
        self.first_tokens.clear()


def engine_from_config(tmp: Path, llm_section: str) -> LLMEngine:
    """What ``serve --llm --config FILE`` does with the file's ``llm:`` section."""
    path = tmp / "deploy.yaml"
    path.write_text(f"llm:\n{llm_section}")
    return build_llm_engine(None, load_spec(path), **TINY)


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    common = ("  policy: priority\n  max_num_seqs: 1\n  max_waiting_seqs: 16\n  num_kv_blocks: 64\n"
              "  block_size: 16\n  max_model_len: 256\n  max_num_batched_tokens: 256\n")
    engines = {
        "strict": engine_from_config(tmp_path_factory.mktemp("strict"),
                                     common + "  max_priority_wait_s: 3600\n"),  # aging out of play
        "aging": engine_from_config(tmp_path_factory.mktemp("aging"),
                                    common + f"  max_priority_wait_s: {AGING_S}\n"),
    }
    served: dict[str, Served] = {}
    try:
        with live_server(FaultyExecutor(), engines=[llm_routes(engines["strict"], "m")],
                         serving=ServingOptions(request_timeout_s=60.0)) as strict_srv, \
             live_server(FaultyExecutor(), engines=[llm_routes(engines["aging"], "m")],
                         serving=ServingOptions(request_timeout_s=60.0)) as aging_srv:
            for name, srv in (("strict", strict_srv), ("aging", aging_srv)):
                served[name] = record(Served(srv.url, engines[name]))
            yield served
    finally:
        for e in engines.values():
            e.shutdown()


def record(s: Served) -> Served:
    submit = s.engine.submit

    def recording_submit(prompts: Any, params: Any = None, priority: int = 0, deadline: Any = None,
                         *rest: Any) -> Any:
        reqs = submit(prompts, params, priority, deadline, *rest)
        s.submitted.append((priority, [r.seq_id for r in reqs]))
        return reqs

    def on_token(ev: TokenEvent) -> None:
        if ev.ttft_s is not None:
            s.first_tokens.append(ev.seq_id)

    s.engine.submit = recording_submit  # type: ignore[method-assign]
    s.engine.observers.append(on_token)
    return s


class Sender:
    """Requests sent from threads, one at a time into the engine: each is in the engine (its priority
    recorded) before the next one is sent, so arrival order is send order."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.client = served.client()
        self.threads: list[threading.Thread] = []
        self.results: dict[str, Any] = {}
        self.seq_of: dict[str, int] = {}

    def send(self, name: str, call: Callable[[openai.OpenAI], Any]) -> None:
        n = len(self.served.submitted)

        def run() -> None:
            try:
                self.results[name] = call(self.client)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                self.results[name] = exc

        t = threading.Thread(target=run, name=f"client-{name}", daemon=True)
        t.start()
        self.threads.append(t)
        wait_for(lambda: len(self.served.submitted) > n or name in self.results, 30, f"{name} in the engine")
        assert name not in self.results or not isinstance(self.results[name], Exception), self.results[name]
        self.seq_of[name] = self.served.submitted[n][1][0]

    def join(self) -> list[str]:
        """Wait for every answer; return the request names in the order they got their first token."""
        for t in self.threads:
            t.join(60)
        for name, res in self.results.items():
            assert not isinstance(res, Exception), f"{name}: {res!r}"
        name_of = {sid: name for name, sid in self.seq_of.items()}
        return [name_of[sid] for sid in self.served.first_tokens if sid in name_of]


def completion(priority: int | None = None, header: int | None = None,
               max_tokens: int = 3) -> Callable[[openai.OpenAI], Any]:
    def call(client: openai.OpenAI) -> Any:
        body: dict[str, Any] = {"ignore_eos": True}
        if priority is not None:
            body["priority"] = priority
        headers = {"X-Priority": str(header)} if header is not None else None
        return client.completions.create(model="m", prompt="A short prompt", max_tokens=max_tokens,
                                         temperature=0, extra_body=body, extra_headers=headers)
    return call


def chat(header: int, max_tokens: int = 3) -> Callable[[openai.OpenAI], Any]:
    def call(client: openai.OpenAI) -> Any:
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True},
                                              extra_headers={"X-Priority": str(header)})
    return call


def held_engine(served: Served) -> WatchedGate:
    """Hold the engine's steps; the test sends a first request, which the engine admits and holds."""
    served.reset()
    return WatchedGate(served.engine.runner)


# -- the order -------------------------------------------------------------------------------------
def test_urgent_requests_sent_after_waiting_low_ones_get_their_first_token_before_them(
        deployments: dict[str, Served]) -> None:
    served = deployments["strict"]
    gate = held_engine(served)
    sender = Sender(served)
    try:
        sender.send("low0", completion(priority=LOW))
        assert gate.entered.wait(30), "the engine never started the first request"  # low0 runs, held
        for i in (1, 2, 3):
            sender.send(f"low{i}", completion(priority=LOW))
        sender.send("urgent_body", completion(priority=URGENT))
        sender.send("urgent_header_chat", chat(header=URGENT))  # X-Priority on the chat route
    finally:
        gate.remove()
    order = sender.join()
    assert order == ["low0", "urgent_body", "urgent_header_chat", "low1", "low2", "low3"]
    assert [p for p, _ in served.submitted] == [LOW] * 4 + [URGENT, URGENT]


def test_a_low_request_queued_past_the_aging_bound_goes_before_younger_urgent_ones(
        deployments: dict[str, Served]) -> None:
    """Strict priority would serve the three urgent requests first (the test above); aged, the low one
    has only what arrived before it ahead of it."""
    served = deployments["aging"]
    assert served.engine.config.max_priority_wait_s == AGING_S
    gate = held_engine(served)
    sender = Sender(served)
    try:
        sender.send("low0", completion(priority=LOW))
        assert gate.entered.wait(30), "the engine never started the first request"
        sender.send("low1", completion(priority=LOW))
        low1_in_engine = time.monotonic()  # its arrival was at or before this
        for i in range(3):
            sender.send(f"urgent{i}", completion(header=URGENT))
        # the one wall-clock wait: until low1 has queued past the bound (a slow machine only waits longer)
        wait_for(lambda: time.monotonic() >= low1_in_engine + AGING_S, 10 + AGING_S, "the aging bound")
    finally:
        gate.remove()
    assert sender.join() == ["low0", "low1", "urgent0", "urgent1", "urgent2"]


# -- the header --------------------------------------------------------------------------------------
def test_x_priority_sets_the_priority_when_the_body_has_none(deployments: dict[str, Served]) -> None:
    served = deployments["strict"]
    served.reset()
    client = served.client()
    completion(header=7, max_tokens=1)(client)
    completion(priority=3, header=7, max_tokens=1)(client)  # the body wins
    completion(max_tokens=1)(client)  # neither: 0
    chat(header=-(2**31) + 1, max_tokens=1)(client)
    completion(header=2**31 - 1, max_tokens=1)(client)
    assert [p for p, _ in served.submitted] == [7, 3, 0, -(2**31) + 1, 2**31 - 1]


@pytest.mark.parametrize("value", ["urgent", "1.5", "", str(2**31), str(-(2**31) - 1), "1e3"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_malformed_x_priority_is_a_400_naming_the_header(deployments: dict[str, Served], path: str,
                                                           value: str) -> None:
    served = deployments["strict"]
    served.reset()
    body: dict[str, Any] = {"model": "m", "max_tokens": 1}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user",
                                                                                   "content": "x"}]})
    r = httpx.post(served.url + path, json=body, headers={"X-Priority": value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_value", "x-priority")
    assert err["type"] == "invalid_request_error" and "x-priority" in err["message"]
    assert not served.submitted  # refused before anything reached the engine


def test_the_openai_client_sees_a_bad_x_priority_as_a_bad_request(deployments: dict[str, Served]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        deployments["strict"].client().completions.create(model="m", prompt="x", max_tokens=1,
                                                          extra_headers={"X-Priority": "soon"})
    assert "x-priority" in str(err.value)


# -- the config file ----------------------------------------------------------------------------------
def test_the_config_files_llm_section_sets_the_policy_and_aging_of_serve_llm(
        deployments: dict[str, Served]) -> None:
    assert {name: (s.engine.config.policy, s.engine.config.max_priority_wait_s, s.engine.config.max_num_seqs)
            for name, s in deployments.items()} == {"strict": ("priority", 3600, 1),
                                                    "aging": ("priority", AGING_S, 1)}
