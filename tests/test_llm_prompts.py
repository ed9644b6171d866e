"""``runtime.llm.engine.PromptEncoder``: tokenising in its pool; fixed messages for what it cannot take."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchpilot.models.llm.tokenizer import load_tokenizer
from batchpilot.runtime.llm.engine import PromptEncoder, RequestRejected


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    enc = PromptEncoder(load_tokenizer(None, 4096), 4096, threads=2)
    yield enc  # type: ignore[misc]
    enc.close()


def test_the_pool_gives_the_same_ids_as_this_thread(encoder: PromptEncoder) -> None:
    async def both() -> tuple[list[int], list[int]]:
        return (await encoder.encode_async("the same text"),
                await encoder.encode_chat_async([{"role": "user", "content": "hi"}]))

    ids, chat = asyncio.run(both())
    assert ids == encoder.encode("the same text") and chat == encoder.encode_chat([{"role": "user",
                                                                                   "content": "hi"}])


def test_tokenising_runs_on_a_pool_thread(encoder: PromptEncoder) -> None:
    seen: list[str] = []
    original = encoder.encode

    def spy(prompt: str | list[int], tokenizer: object = None) -> list[int]:
        seen.append(threading.current_thread().name)
        return original(prompt, tokenizer)

    encoder.encode = spy  # type: ignore[method-assign]
    try:
        asyncio.run(encoder.encode_async("where"))
    finally:
        del encoder.encode
    assert seen and seen[0].startswith("batchpilot-llm-tokenize")


def test_a_lone_surrogate_is_refused_with_a_fixed_message(encoder: PromptEncoder) -> None:
    with pytest.raises(RequestRejected) as err:
        asyncio.run(encoder.encode_async("bad \ud800 text"))
    assert err.value.param == "prompt" and "surrogate" not in str(err.value).lower()
    with pytest.raises(RequestRejected) as err:
        encoder.encode_chat([{"role": "user", "content": "bad \udfff"}])
    assert err.value.param == "messages"


def test_token_ids_outside_the_vocabulary_are_refused(encoder: PromptEncoder) -> None:
    for ids in ([], [-1], [4096], [1, 2, 99_999]):
        with pytest.raises(RequestRejected):
            encoder.encode(ids)
    assert encoder.encode([1, 2, 4095]) == [1, 2, 4095]


def test_all_or_none_raises_the_first_failure_while_siblings_still_run() -> None:
    from batchpilot.server.llm.routes import _all_or_none

    async def main() -> None:
        never = asyncio.Event()

        async def slow() -> int:
            await never.wait()
            return 1

        async def bad() -> int:
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):
            await _all_or_none([slow(), bad()])

    asyncio.run(asyncio.wait_for(main(), 10))
