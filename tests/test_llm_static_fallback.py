"""runtime/llm/fallback.py: the static-batching fallback answers as the main engine does, on its weights."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.runtime.llm.build import build_failover, build_fallback, build_llm_engine
from batchpilot.runtime.llm.engine import (
    EngineBusy,
    GenerationFailed,
    LLMEngine,
    RequestRejected,
    RequestTimedOut,
)

PROMPTS = ["hello world", "the quick brown fox jumps", "a", "def f(x): return x", "import os", "x = 1"]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, Any]]:
    engine = build_llm_engine(None, num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                              num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=128, block_size=16,
                              max_num_batched_tokens=256, max_model_len=256, max_num_seqs=4,
                              max_waiting_seqs=8, model_name="m", tokenizer_threads=1, initializer_range=0.06)
    fallback = build_fallback(engine, max_batch_size=4)  # 6 prompts: two static batches
    yield engine, fallback
    fallback.shutdown()
    engine.shutdown()


async def _answers(engine: Any, ids: list[list[int]], params: SamplingParams) -> list[tuple[Any, ...]]:
    out = []
    for req in engine.submit(ids, params):
        tokens, text, last = [], "", None
        async for item in req:
            tokens += item.token_ids
            text += item.text
            last = item
        assert last is not None
        out.append((tokens, text, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens))
    return out


def answers(engine: Any, prompts: list[str], params: SamplingParams) -> list[tuple[Any, ...]]:
    ids = [engine.prompts.encode(p) for p in prompts] if hasattr(engine, "prompts") else prompts
    return asyncio.run(_answers(engine, ids, params))  # type: ignore[arg-type]


@pytest.mark.parametrize("params", [
    pytest.param(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), id="greedy"),
    pytest.param(SamplingParams(max_tokens=40, temperature=0), id="greedy-eos"),
    pytest.param(SamplingParams(max_tokens=30, temperature=0, stop=("e",)), id="stop-string"),
    pytest.param(SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(796,)), id="stop-token"),
    pytest.param(SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
                 id="seeded-sample"),
])
def test_the_fallback_answers_token_for_token_as_the_main_engine(engines: tuple[LLMEngine, Any],
                                                                 params: SamplingParams) -> None:
    engine, fallback = engines
    ids = [engine.prompts.encode(p) for p in PROMPTS]
    main = asyncio.run(_answers(engine, ids, params))
    assert asyncio.run(_answers(fallback, ids, params)) == main


def test_the_fallback_model_shares_the_runners_tensors(engines: tuple[LLMEngine, Any]) -> None:
    engine, fallback = engines
    hf, w = fallback.model, engine.runner.w
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == w.layers[0].qkv.untyped_storage().data_ptr()
    assert hf.model.embed_tokens.weight.data_ptr() == w.embed.data_ptr()


def test_a_request_past_its_deadline_times_out_and_one_that_never_fits_is_refused(
        engines: tuple[LLMEngine, Any]) -> None:
    _, fallback = engines
    before = dict(fallback.admission.refused)

    async def late() -> BaseException | None:
        [req] = fallback.submit([[5, 6, 7]], SamplingParams(max_tokens=5), deadline=time.monotonic() - 1)
        try:
            async for _ in req:
                pass
        except RequestTimedOut as exc:
            return exc
        return None

    assert isinstance(asyncio.run(late()), RequestTimedOut)

    async def too_long() -> None:
        fallback.submit([[5] * 200], SamplingParams(max_tokens=100))

    with pytest.raises(RequestRejected, match="context length"):
        asyncio.run(too_long())
    assert fallback.num_pending == 0
    with pytest.raises(EngineBusy):
        fallback.check_room(fallback.max_admitted + 1)  # what the routes ask before tokenising
    counted = {k: v - before.get(k, 0) for k, v in fallback.admission.refused.items()}
    assert counted == {"timeout": 1, "context_length_exceeded": 1, "queue_full": 1}  # one per request
    rebuilt = fallback.restarted()
    try:
        assert rebuilt.admission.refused == fallback.admission.refused  # the counts go on
    finally:
        rebuilt.shutdown()


def test_a_client_that_leaves_frees_its_row_and_the_batch_goes_on(engines: tuple[LLMEngine, Any]) -> None:
    _, fallback = engines

    async def run() -> tuple[int, int]:
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        leaver, stayer = fallback.submit([[5, 6], [7, 8]], params)
        await anext(leaver)
        leaver.close()
        n = 0
        async for _ in stayer:
            n += 1
        return n, len(leaver.seq.output_token_ids)

    stayed, left = asyncio.run(run())
    assert stayed == 60 and left < 60
    assert fallback.num_pending == 0


def test_a_failing_generate_fails_its_batch_and_the_thread_goes_on(engines: tuple[LLMEngine, Any]) -> None:
    _, fallback = engines
    original = fallback.model.generate
    fallback.model.generate = lambda **kw: (_ for _ in ()).throw(RuntimeError("simulated kernel failure"))
    try:
        with pytest.raises(GenerationFailed):
            answers(fallback, [[5, 6]], SamplingParams(max_tokens=3))  # type: ignore[list-item]
    finally:
        fallback.model.generate = original
    assert fallback.is_alive
    assert answers(fallback, [[5, 6]], SamplingParams(max_tokens=3))[0][2] == "length"  # type: ignore[list-item]


def test_build_failover_refuses_an_unknown_fallback() -> None:
    with pytest.raises(ValueError, match="static, off"):
        build_failover(object(), "dynamic")  # type: ignore[arg-type]


def test_shutdown_answers_what_the_fallback_still_holds(engines: tuple[LLMEngine, Any]) -> None:
    engine, _ = engines
    fallback = build_fallback(engine, max_batch_size=1)
    started = threading.Event()
    original = fallback.model.generate

    def held(**kw: Any) -> Any:
        started.set()
        fallback._stopping = True  # shutdown arrives mid-batch: the stopping criterion ends every row
        return original(**kw)

    fallback.model.generate = held

    async def run() -> list[str]:
        reqs = fallback.submit([[5, 6], [7, 8]], SamplingParams(max_tokens=50, ignore_eos=True))
        seen = []
        for req in reqs:
            try:
                async for _ in req:
                    pass
                seen.append("done")
            except Exception as exc:
                seen.append(type(exc).__name__)
        return seen

    assert asyncio.run(run()) == ["EngineStopped", "EngineStopped"]
    fallback.shutdown()
    assert not fallback.is_alive


def test_serve_llm_builds_the_failover_its_settings_ask_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchpilot.core.deployment import DeploymentSpec
    from batchpilot.server.build import llm_engine, llm_failover
    from batchpilot.server.config import ServerConfig

    class Settings:  # ServerConfig plus the two failover settings serve's flags give
        def __init__(self, **extra: Any) -> None:
            self.base, self.extra = ServerConfig(llm=True), extra

        def __getattr__(self, name: str) -> Any:
            return self.extra[name] if name in self.extra else getattr(self.base, name)

    small = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, num_kv_blocks=16, max_model_len=128, model_name="m")
    monkeypatch.setattr("batchpilot.runtime.llm.build.build_llm_engine",
                        lambda path, **kw: build_llm_engine(path, **small))
    for extra, has_fallback, bound in (({}, True, 60.0),
                                       ({"llm_fallback": "off", "llm_stall_timeout_s": 3.0}, False, 3.0)):
        settings: Any = Settings(**extra)
        failover = llm_failover(settings, llm_engine(settings, DeploymentSpec()))
        try:
            assert (failover.fallback is not None) == has_fallback
            assert failover.watchdog.timeout_s() == bound and failover.is_alive
        finally:
            failover.shutdown()
