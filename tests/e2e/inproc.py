"""A real uvicorn server in a thread of the test process, serving ``create_app`` with any executor.

The reliability tests need executors the CLI cannot load (one that raises on a poison input, one that
crashes and recovers, one held on a gate so a batch stays "running" as long as the test wants); this
starts the same app ``batchpilot serve`` builds, on a free 127.0.0.1 port, spoken to over real HTTP.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from batchpilot.bench.scrape import parse_metrics
from batchpilot.core.batch import Batch
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import ServingOptions
from batchpilot.runtime.errors import ExecutorCrashed
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig

POISON = 4242  # a token id that makes FaultyExecutor.run raise (a "model bug" on one input)
CRASH = 4343  # a token id that makes it raise ExecutorCrashed while crashes_left > 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class FaultyExecutor(NoopExecutor):
    """The no-op encoder with faults on demand, a gate that holds runs, and a record of every batch."""

    dim: int = 8
    delay_s: float = 0.0
    max_length: int = 512
    vocab_size: int = 30522
    crashes_left: int = 0
    recoveries: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    batches: list[Batch] = field(default_factory=list)  # every batch prepared
    runs: list[list[Any]] = field(default_factory=list)  # the payloads of every run() call
    running: threading.Event = field(default_factory=threading.Event)
    recover_gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        super().__init__(self.dim, self.delay_s, self.max_length, self.vocab_size)
        self.gate.set()  # open: runs do not wait
        self.recover_gate.set()

    def prepare(self, batch: Batch) -> list[Any]:
        self.batches.append(batch)
        return [r.payload for r in batch.requests]

    def run(self, prepared: list[Any]) -> list[Any]:
        self.runs.append(list(prepared))
        self.running.set()
        try:
            if not self.gate.wait(30):
                raise TimeoutError("test gate never opened")
        finally:
            self.running.clear()
        flat = [t for p in prepared for t in p]
        if CRASH in flat and self.crashes_left > 0:
            self.crashes_left -= 1
            raise ExecutorCrashed("simulated device failure")
        if POISON in flat:
            raise ValueError("simulated model bug on a poison input")
        return super().run(prepared)

    def recover(self) -> None:
        if not self.recover_gate.wait(30):
            raise TimeoutError("test recover gate never opened")
        self.recoveries += 1


class StepGate:
    """Wraps an LLM runner's ``forward`` so each engine step takes a permit: a test decides how many
    steps run (``allow``) instead of racing the engine's speed. ``open()`` lets everything through."""

    def __init__(self, runner: Any, permits: int = 0) -> None:
        self.runner = runner
        self.original = runner.forward
        self.sem = threading.Semaphore(permits)
        self.is_open = False
        runner.forward = self.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_open and not self.sem.acquire(timeout=30):
            raise TimeoutError("test step gate never opened")
        return self.original(*args, **kwargs)

    def allow(self, n: int) -> None:
        self.sem.release(n)

    def open(self) -> None:
        self.is_open = True
        self.sem.release(1000)

    def remove(self) -> None:
        self.open()
        self.runner.forward = self.original


@contextmanager
def engine_held_full(engine: Any, send: Callable[[int], httpx.Response]) -> Iterator[list[httpx.Response]]:
    """Hold ``engine``'s steps and fill it: ``engine.max_admitted`` requests ``send(i)`` from threads,
    admitted and waiting. Yields their responses (filled once they are answered, after the block: the
    gate is removed and the threads joined on exit)."""
    gate = StepGate(engine.runner, permits=0)
    held: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda i=i: held.append(send(i))) for i in range(engine.max_admitted)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: engine.num_pending == engine.max_admitted, 10, "the queue full")
        yield held
    finally:
        gate.remove()
        for t in threads:
            t.join(30)


@dataclass
class LiveServer:
    url: str
    app: Any
    server: uvicorn.Server

    @property
    def service(self) -> Any:
        return self.app.state.service

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        return scrape(self.url, headers)


def scrape(url: str, headers: dict[str, str] | None = None, by_model: bool = False) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` (``batchpilot.bench.scrape.parse_metrics``:
    the ``model`` label summed away unless ``by_model``)."""
    return parse_metrics(httpx.get(url + "/metrics", headers=headers, timeout=10).text, histograms=True,
                         by_model=by_model)


@contextmanager
def live_server(executor: Any, config: SchedulerConfig | None = None, *,
                cost_model: CostModel | None = None, engines: Sequence[MountedEngine] = (),
                models: Sequence[ServedModel] = (), **settings: Any) -> Iterator[LiveServer]:
    """The real app on a free port in a thread. ``config`` is used as given (tests that want the
    server's deployment pass ``resolve_deployment(...).scheduler``); ``models`` are ``ServedModel``s
    (with ``executor=None``, the only ones served); ``engines`` are mounted beside them."""
    settings.setdefault("serving", ServingOptions(request_timeout_s=30.0))
    settings.setdefault("drain_timeout_s", 5.0)
    cfg = ServerConfig(port=free_port(), **settings)
    first = [ServedModel(executor, config or SchedulerConfig(), cost_model)] if executor is not None else []
    app: Any = create_app(cfg, [*first, *models], engines)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{cfg.port}", app, server)
    finally:
        server.should_exit = True
        thread.join(15)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0,
             what: str | Callable[[], str] = "condition") -> None:
    """Poll a condition that the server reaches asynchronously (a bounded wait, not a timing assertion).
    ``what`` names it in the failure; a callable is called then (to say what was last seen)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.01)


_ENGINE: Any = None


def small_llm_engine() -> Any:
    """One process-wide small LLM engine (2 layers x 256, 64 KV blocks of 16, context 256), started once:
    building it costs seconds, and the LLM routes' behaviour does not depend on the model's size."""
    global _ENGINE
    if _ENGINE is None:
        from batchpilot.runtime.llm.build import build_llm_engine

        _ENGINE = build_llm_engine(None, num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                                   num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=64,
                                   block_size=16, max_num_batched_tokens=256, max_model_len=256,
                                   max_num_seqs=4, model_name="tiny-llm")
    return _ENGINE


def llm_routes(engine: Any, model_name: str | None = None) -> MountedEngine:
    """The LLM routes over ``engine``, mounted beside the models (``model_name`` listed by /v1/models)."""
    from batchpilot.server.llm.routes import make_llm_router
    from batchpilot.server.tenants import engine_usage_json

    return MountedEngine(lambda registry: make_llm_router(engine, registry), model_name,
                         tenant_usage=lambda: engine_usage_json(engine))
