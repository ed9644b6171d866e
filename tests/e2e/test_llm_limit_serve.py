"""``serve --llm --llm-max-*``: the LLM request-size limits set from the command line, end to end.

Two real ``batchpilot serve --llm`` processes (no-op encoder, the small default LLM) on free 127.0.0.1
ports, spoken to with the ``openai`` client: one with every limit set small, one with the defaults. Each
request over a small limit is a 400 naming the field and the limit; the default server answers the
very same request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import running_server

LLM = ["--noop", "--no-warmup", "--llm", "--num-kv-blocks", "64", "--max-num-seqs", "4", "--threads", "1"]
SMALL = ["--llm-max-prompts", "2", "--llm-max-prompt-chars", "64", "--llm-max-messages", "2",
         "--llm-max-stop", "1", "--llm-max-stop-chars", "8", "--llm-max-stop-token-ids", "1"]


def msgs(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(n)]


# (route, request body, param and code of the small server's 400, what its message says)
OVER: dict[str, tuple[str, dict[str, Any], str, str, str]] = {
    "prompts": ("completions", {"prompt": ["a", "b", "c"]}, "prompt", "too_many_prompts", "at most 2"),
    "prompt_chars": ("completions", {"prompt": "x" * 65}, "prompt", "prompt_too_long", "at most 64"),
    "conversation_chars": ("chat", {"messages": [{"role": "user", "content": "y" * 65}]}, "messages",
                           "prompt_too_long", "at most 64"),
    "messages": ("chat", {"messages": msgs(3)}, "messages", "too_many_messages", "at most 2"),
    "stop": ("completions", {"prompt": "a", "stop": ["x", "y"]}, "stop", "too_many_stop", "at most 1"),
    "stop_chars": ("completions", {"prompt": "a", "stop": ["123456789"]}, "stop", "stop_too_long",
                   "at most 8"),
    "stop_token_ids": ("completions", {"prompt": "a", "extra_body": {"stop_token_ids": [1, 2]}},
                       "stop_token_ids", "too_many_stop_token_ids", "at most 1"),
}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with running_server([*LLM, *SMALL], tmp_path_factory.mktemp("llm-small")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with running_server(LLM, tmp_path_factory.mktemp("llm-default")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def send(client: openai.OpenAI, route: str, body: dict[str, Any]) -> Any:
    model = client.models.list().data[-1].id  # the LLM is listed after the encoder
    if route == "chat":
        return client.chat.completions.create(model=model, max_tokens=2, **body)
    return client.completions.create(model=model, max_tokens=2, **body)


@pytest.mark.parametrize("case", sorted(OVER))
def test_a_request_over_a_flag_set_limit_is_a_400_naming_the_field_and_the_limit(
        small: openai.OpenAI, case: str) -> None:
    route, body, param, code, says = OVER[case]
    with pytest.raises(openai.BadRequestError) as err:
        send(small, route, body)
    assert err.value.status_code == 400
    error = err.value.response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert says in error["message"], error["message"]


@pytest.mark.parametrize("case", sorted(OVER))
def test_the_same_request_is_served_under_the_default_limits(default: openai.OpenAI, case: str) -> None:
    route, body, *_ = OVER[case]
    answer = send(default, route, body)
    assert answer.choices and answer.usage is not None


def test_a_request_within_the_small_limits_is_served(small: openai.OpenAI) -> None:
    answer = send(small, "completions", {"prompt": ["a", "b"], "stop": ["12345678"],
                                         "extra_body": {"stop_token_ids": [1]}})
    assert len(answer.choices) == 2

