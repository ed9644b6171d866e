"""Size limits of one LLM request, checked on the parsed body before any tokenisation: each is a 400 that
names the field, the size sent and the limit.

Defaults, in line with TEI and vLLM: 64 prompts per completion (TEI's client batch is 32, the engine
runs 64 sequences at once), 1 MiB of characters per prompt and per conversation (more cannot fit a
context of thousands of tokens; TEI's payload limit is 2 MB), 512 messages, OpenAI's 4 stop sequences
of at most 256 characters each, 64 ``stop_token_ids``, and ``max_tokens`` below the model's context
length. Token-id prompts longer than the context are refused before they reach the engine. ``serve``
takes each as a flag, ``--llm-max-prompts`` and the like (``llm_limit_flags.py``);
``make_llm_router(..., limits=LLMLimits(...))`` takes them in code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from batchpilot.server.errors import APIError


@dataclass(frozen=True)
class LLMLimits:
    max_prompts: int = 64
    max_prompt_chars: int = 1 << 20
    max_messages: int = 512
    max_stop: int = 4
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"llm limits: {f.name} must be >= 1, got {getattr(self, f.name)}")

    def check_prompts(self, prompts: Sequence[str | list[int]], max_model_len: int) -> None:
        if len(prompts) > self.max_prompts:
            raise _too_big("prompt", f"{len(prompts)} prompts", f"{self.max_prompts} per request",
                           "too_many_prompts")
        for i, p in enumerate(prompts):
            if isinstance(p, str) and len(p) > self.max_prompt_chars:
                raise _too_big("prompt", f"prompt {i} has {len(p)} characters",
                               f"{self.max_prompt_chars} per prompt", "prompt_too_long")
            if isinstance(p, list) and len(p) >= max_model_len:
                raise APIError(400, f"prompt {i} has {len(p)} token ids; the model's context length is "
                                    f"{max_model_len} tokens, prompt and output together",
                               code="context_length_exceeded", param="prompt")

    def check_messages(self, texts: Sequence[str]) -> None:
        if len(texts) > self.max_messages:
            raise _too_big("messages", f"{len(texts)} messages", f"{self.max_messages} per request",
                           "too_many_messages")
        total = sum(len(t) for t in texts)
        if total > self.max_prompt_chars:
            raise _too_big("messages", f"the messages have {total} characters",
                           f"{self.max_prompt_chars} per request", "prompt_too_long")

    def check_sampling(self, stop: Sequence[str], stop_token_ids: Sequence[int], max_tokens: int | None,
                       max_model_len: int) -> None:
        if len(stop) > self.max_stop:
            raise _too_big("stop", f"{len(stop)} stop sequences", str(self.max_stop), "too_many_stop")
        for i, s in enumerate(stop):
            if not s:
                raise APIError(400, f"stop[{i}] is empty", code="invalid_value", param="stop")
            if len(s) > self.max_stop_chars:
                raise _too_big("stop", f"stop[{i}] has {len(s)} characters",
                               f"{self.max_stop_chars} per stop sequence", "stop_too_long")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise _too_big("stop_token_ids", f"{len(stop_token_ids)} stop token ids",
                           str(self.max_stop_token_ids), "too_many_stop_token_ids")
        if max_tokens is not None and max_tokens >= max_model_len:
            raise APIError(400, f"max_tokens ({max_tokens}) must be less than the model's context length "
                                f"of {max_model_len} tokens (the prompt needs at least one)",
                           code="context_length_exceeded", param="max_tokens")


def _too_big(param: str, what: str, limit: str, code: str) -> APIError:
    return APIError(400, f"{what}; at most {limit}", code=code, param=param)


def header_deadline_ms(raw: Any) -> float | None:
    """``X-Deadline-Ms``: a positive finite number of milliseconds, else a 400."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise APIError(400, "header x-deadline-ms must be a positive number of milliseconds",
                       code="invalid_value", param="x-deadline-ms")
    return value
