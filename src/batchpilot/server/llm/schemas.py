"""Request bodies of the OpenAI-compatible completion routes (pydantic), and their sampling params.

Unknown fields that change nothing (``user``, ``metadata`` ...) are accepted and ignored; fields that
would change the answer and are not served (``echo``, the legacy ``functions``, ``tool_choice: "auto"``
...: ``UNSERVED``) are rejected with a 400 that names the field, never dropped. Served beyond the basics:
``n`` (and ``best_of`` on completions), ``logprobs`` / ``top_logprobs``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, and structured outputs: ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_*`` names, and forced tool calls (``server/llm/tools.py``).
``top_k``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``priority``
and ``deadline_ms`` are extensions (the ``openai`` client sends them in ``extra_body``). Every list has
a hard cap far above the limits of ``llm_limits``, so that validation of a hostile body stops at its
first items instead of building an error for each of millions; the limits themselves are checked after
parsing, with 400s that name them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchpilot.core.llm.sequence import MAX_LOGPROBS, SamplingParams, StructuredOutput
from batchpilot.server.errors import APIError
from batchpilot.server.llm.tools import NamedToolChoice, Tool, ToolPlan, tool_plan

GREEDY_BELOW = 1e-5
CAP = 4096  # items in any list of a request (the limits' defaults are far below)
TOKEN_CAP = 1 << 20  # token ids in one prompt
_Tokens = Annotated[list[int], Field(max_length=TOKEN_CAP)]


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields of the OpenAI API (and vLLM's extensions) that change the answer and that this server does not
# serve: each is refused with a 400 naming it, unless it has the value that changes nothing.
UNSERVED: dict[str, Any] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v == "none",
}
MAX_N = 16  # samples of one prompt (n, best_of)
MAX_CONSTRAINT_CHARS = 1 << 16  # a JSON schema, expression, choice list or grammar
LOGIT_BIAS_CAP = 300  # OpenAI's bound on logit_bias entries


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           code="invalid_value", param="response_format")
        return StructuredOutput("json_schema", json.dumps(schema))


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=CAP)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> StructuredOutput | None:
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                   ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None}
        if len(given) > 1:
            raise APIError(400, f"structured_outputs takes one constraint, got {', '.join(given)}",
                           code="invalid_value", param="structured_outputs")
        if not given:
            return None
        [(kind, value)] = given.items()
        if kind == "json":
            return StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value))
        if kind == "choice":
            return StructuredOutput("choice", json.dumps(value))
        if kind == "json_object":
            return StructuredOutput("json_object")
        return StructuredOutput(kind, value)  # type: ignore[arg-type]


# vLLM's older names of the same constraints
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = 1
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | Annotated[list[str], Field(max_length=CAP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, float], Field(max_length=LOGIT_BIAS_CAP)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # extensions
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)  # below: logits / p overflow
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Field(max_length=CAP)] | None = None
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)  # None: X-Priority, else 0
    deadline_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    def check_supported(self) -> None:
        for name, unchanged in UNSERVED.items():  # fields that change the answer, not served: refused
            value = (self.model_extra or {}).get(name)
            if value is not None and not unchanged(value):
                raise APIError(400, f"{name} is not supported by this server", code="unsupported_value",
                               param=name)
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", code="invalid_value", param="n")

    def constraint(self) -> tuple[StructuredOutput | None, str]:
        """The structured-output constraint the body asks for (at most one way), and the field it came by."""
        found: list[tuple[StructuredOutput, str]] = []
        if self.response_format is not None and (c := self.response_format.constraint()) is not None:
            found.append((c, "response_format"))
        if self.structured_outputs is not None and (c := self.structured_outputs.constraint()) is not None:
            found.append((c, "structured_outputs"))
        for name, kind in GUIDED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None:
                so = StructuredOutputs.model_validate({kind: value})
                c = so.constraint()
                if c is not None:
                    found.append((c, name))
        if len(found) > 1:
            raise APIError(400, "ask for one structured output, got " + ", ".join(n for _, n in found),
                           code="invalid_value", param=found[1][1])
        if found and len(found[0][0].spec) > MAX_CONSTRAINT_CHARS:  # compiling is not free: bounded
            raise APIError(400, f"{found[0][1]}: the constraint has {len(found[0][0].spec)} characters; at "
                                f"most {MAX_CONSTRAINT_CHARS}", code="constraint_too_long", param=found[0][1])
        return found[0] if found else (None, "")

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the answer shows (None: no logprobs)."""
        return None

    def sampling_params(self, default_max_tokens: int, limits: LLMLimits | None = None,
                        max_model_len: int | None = None, vocab_size: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The engine's params, after the limits (a 400 naming the field past its limit)."""
        self.check_supported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        (limits or LLMLimits()).check_sampling(stop, self.stop_token_ids or (), self.requested_max_tokens(),
                                               max_model_len or 2**62)
        try:
            return SamplingParams(
                max_tokens=self.requested_max_tokens() or default_max_tokens,
                # a tiny positive temperature overflows logits / T to inf, a denormal top_p leaves no mass
                # (NaN probabilities: a failed engine step for every sequence in it); both below 1e-5 mean
                # "the most likely token", i.e. greedy (vLLM does the same for temperature)
                temperature=0.0 if min(self.temperature, self.top_p) < GREEDY_BELOW else self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens,
                logit_bias=logit_bias(self.logit_bias, vocab_size),
                logprobs=self.logprobs_asked(),
                structured=structured,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id strings -> bias in [-100, 100]) as sorted pairs; a key that is
    not a token id of this model is a 400."""
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < (vocab_size or 2**31):
            raise APIError(400, f"logit_bias key {key!r} is not a token id of this model (0 to "
                                f"{(vocab_size or 2**31) - 1})", code="invalid_value", param="logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], Field(max_length=CAP)] | _Tokens
             | Annotated[list[_Tokens], Field(max_length=CAP)])
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice"):
            if (self.model_extra or {}).get(name) not in (None, [], "none"):
                raise APIError(400, f"{name} is served on /v1/chat/completions, not on /v1/completions",
                               code="unsupported_value", param=name)
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be >= n ({self.n})", code="invalid_value",
                           param="best_of")
        if self.best_of not in (None, self.n) and self.stream:
            raise APIError(400, "best_of cannot be streamed (the best are known at the end)",
                           code="invalid_value", param="best_of")

    @property
    def samples(self) -> int:
        """Sequences per prompt: ``best_of`` when it asks for more than ``n``."""
        return max(self.n, self.best_of or 0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, value: Any) -> Any:
        """One pass over the items before the union tries each shape on each of them: a list that is
        none of the four shapes is one error, not one per item and shape."""
        if isinstance(value, list) and len(value) <= TOKEN_CAP:
            kinds = {type(x) for x in value}
            ok = kinds <= {int} or kinds <= {str} or (
                kinds <= {list} and all(type(t) is int for x in value for t in x))
            if not ok:
                raise ValueError("prompt must be a string, a list of strings, a list of token ids or a "
                                 "list of token-id lists")
        return value

    def prompts(self) -> list[str | list[int]]:
        if self.echo:
            raise APIError(400, "echo is not supported", code="unsupported_value", param="echo")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", code="invalid_value", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=CAP)] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise APIError(400, "only text content parts are supported", code="unsupported_value",
                           param="messages")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=CAP)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=CAP)] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value",
                           param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_plan(self) -> ToolPlan | None:
        return tool_plan(self.tools, self.tool_choice)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]


# Size limits of one LLM request, checked on the parsed body before any tokenisation: each is a 400 that
# names the field, the size sent and the limit.
#
# Defaults, in line with TEI and vLLM: 64 prompts per completion (TEI's client batch is 32, the engine
# runs 64 sequences at once), 1 MiB of characters per prompt and per conversation (more cannot fit a
# context of thousands of tokens; TEI's payload limit is 2 MB), 512 messages, OpenAI's 4 stop sequences
# of at most 256 characters each, 64 ``stop_token_ids``, and ``max_tokens`` below the model's context
# length. Token-id prompts longer than the context are refused before they reach the engine. ``serve``
# takes each as a flag, ``--llm-max-prompts`` and the like (``llm_limit_flags.py``);
# ``make_llm_router(..., limits=LLMLimits(...))`` takes them in code.

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
