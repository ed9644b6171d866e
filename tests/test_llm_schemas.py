"""The LLM request limits (``server.llm.schemas``) and the schema's hard caps, on parsed bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from batchpilot.server.errors import APIError
from batchpilot.server.llm.schemas import (
    CAP,
    ChatCompletionRequest,
    CompletionRequest,
    LLMLimits,
    header_deadline_ms,
)

CONTEXT = 1024


def refusal(body: dict[str, Any], chat: bool = False, limits: LLMLimits | None = None) -> tuple[Any, Any]:
    limits = limits or LLMLimits()
    with pytest.raises(APIError) as err:
        if chat:
            req = ChatCompletionRequest(**body)
            limits.check_messages([m["content"] for m in req.chat()])
        else:
            req = CompletionRequest(**body)
            limits.check_prompts(req.prompts(), CONTEXT)
        req.sampling_params(16, limits, CONTEXT)
    assert err.value.status == 400
    return err.value.code, err.value.param


@pytest.mark.parametrize(("body", "chat", "code", "param"), [
    ({"prompt": ["p"] * 65}, False, "too_many_prompts", "prompt"),
    ({"prompt": "x" * ((1 << 20) + 1)}, False, "prompt_too_long", "prompt"),
    ({"prompt": [[5] * CONTEXT]}, False, "context_length_exceeded", "prompt"),
    ({"prompt": "p", "max_tokens": CONTEXT}, False, "context_length_exceeded", "max_tokens"),
    ({"prompt": "p", "stop": list("abcde")}, False, "too_many_stop", "stop"),
    ({"prompt": "p", "stop": ["s" * 257]}, False, "stop_too_long", "stop"),
    ({"prompt": "p", "stop": ["ok", ""]}, False, "invalid_value", "stop"),
    ({"prompt": "p", "stop_token_ids": list(range(65))}, False, "too_many_stop_token_ids", "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "hi"}] * 513}, True, "too_many_messages", "messages"),
    ({"messages": [{"role": "user", "content": "y" * (1 << 19)}] * 3}, True, "prompt_too_long", "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": CONTEXT}, True,
     "context_length_exceeded", "max_tokens"),
])
def test_each_limit_is_a_400_naming_its_field(body: dict[str, Any], chat: bool, code: str,
                                              param: str) -> None:
    assert refusal(body, chat) == (code, param)


def test_at_the_limits_is_accepted() -> None:
    limits = LLMLimits()
    req = CompletionRequest(prompt=["p"] * 64, stop=["s" * 256] * 4, stop_token_ids=list(range(64)),
                            max_tokens=CONTEXT - 1)
    limits.check_prompts(req.prompts(), CONTEXT)
    params = req.sampling_params(16, limits, CONTEXT)
    assert params.max_tokens == CONTEXT - 1 and len(params.stop) == 4


def test_limits_are_configurable_and_checked() -> None:
    assert refusal({"prompt": ["a", "b"]}, limits=LLMLimits(max_prompts=1)) == ("too_many_prompts", "prompt")
    with pytest.raises(ValueError, match="max_stop"):
        LLMLimits(max_stop=0)


def test_a_hostile_list_stops_validation_at_the_cap() -> None:
    """A list of a million wrong items fails on its length, not with an error per item."""
    for items in ([{}] * 1_000_000, [[{}] * 1000] * 1000, [1] * 999 + ["x"]):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate_json(json.dumps({"prompt": items}))
        assert err.value.error_count() < 10
    for field in ("stop", "stop_token_ids"):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate_json(json.dumps({"prompt": "p", field: [{}] * (10 * CAP)}))
        assert err.value.error_count() < 10
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{}] * (10 * CAP)}))
    assert err.value.error_count() < 10


@pytest.mark.parametrize("raw", ["0", "-5", "nan", "inf", "1e400", "soon", "9" * 400])
def test_a_bad_deadline_header_is_a_400(raw: str) -> None:
    with pytest.raises(APIError) as err:
        header_deadline_ms(raw)
    assert err.value.status == 400 and err.value.param == "x-deadline-ms"


def test_a_good_deadline_header_is_read() -> None:
    assert header_deadline_ms("250.5") == 250.5 and header_deadline_ms(None) is None
