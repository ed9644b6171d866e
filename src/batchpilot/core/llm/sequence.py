"""One generation request as the LLM scheduler sees it: tokens, progress, priority, sampling params.

Plain data, no torch. The only progress counter that matters to scheduling is
``num_computed_tokens``: how many of ``all_token_ids`` already have their keys and values in the
KV cache. Everything else follows from it:

```
 all_token_ids = prompt_token_ids + output_token_ids
 |<------------- num_computed_tokens ------------->|<- to compute ->|
 | KV in cache (blocks in block_table)             | next chunk     |
```

A fresh sequence computes its prompt (possibly in chunks); the step that computes the last pending
token also samples the next one. A decoding sequence has exactly one pending token (the last one it
sampled). Preemption by recompute sets ``num_computed_tokens`` back to 0: prompt *and* outputs so
far are prefilled again, so the sequence resumes exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Literal

from batchpilot.core.request import DEFAULT_TENANT


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """OpenAI ``finish_reason`` values plus the two endings a client did not ask for."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # cancelled by the client
    REJECTED = "rejected"  # can never fit: see Sequence.reject_reason
    EXPIRED = "expired"  # its deadline passed first (``LLMScheduler.expire``; the server's 504)


StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the answer's text, applied as a token mask each step (``models/llm/grammar.py``).

    ``spec`` is plain text: a JSON schema (json_schema), ignored (json_object: any JSON object), a regular
    expression (regex), the JSON list of allowed strings (choice), or an EBNF grammar (grammar)."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output: kind {self.kind!r}; choose one of "
                             f"{', '.join(STRUCTURED_KINDS)}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy.

    ``stop`` strings are matched by the engine on detokenised text (core has no tokenizer); every
    other stop condition is checked here. ``seed`` makes one request's sampling reproducible no
    matter which other requests share its batches.

    What changes the logits before a token is chosen, in this order (``models/llm/sampler.py``): the
    structured-output mask, ``logit_bias``, ``min_tokens`` (EOS and ``stop_token_ids`` masked until that
    many tokens are out), ``repetition_penalty`` (HF's rule over prompt and output tokens), then
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's rule over output tokens). ``logprobs``: None
    = none returned, k >= 0 = the chosen token's log-probability and the k most likely alternatives, of
    the model's own distribution (before any of the above; what HF's ``log_softmax`` of the logits gives).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"sampling: max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling: temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling: top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling: {name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.01 <= self.repetition_penalty <= 100.0:  # a smaller one overflows logits / penalty to inf
            raise ValueError(f"sampling: repetition_penalty must be in [0.01, 100], got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"sampling: min_tokens must be in [0, max_tokens = {self.max_tokens}], got "
                             f"{self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"sampling: logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("sampling: each logit_bias value must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def for_sample(self, j: int) -> SamplingParams:
        """The params of a prompt's ``j``-th sample (``n > 1``): a seeded request's samples draw from
        ``seed + j``, so each is reproducible and none repeats another; unseeded ones need nothing."""
        if j == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=(self.seed + j + 2**63) % 2**64 - 2**63)

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties, or EOS held back by min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens)


MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and its growing output. ``priority``: lower is more urgent (vLLM convention).
    ``deadline``: when the driver gives up on it, on the clock of ``arrival`` (None: never;
    ``core/llm/admission.request_deadline``)."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    reject_reason: str | None = None
    deadline: float | None = None
    # the samples of one prompt (``n > 1``) share a group, named by its first sequence's id: the
    # scheduler admits a group's followers once its first has computed the prompt (so they take its
    # KV blocks from the prefix cache), and preempts a group's running members together
    group: int | None = None
    tenant: str = DEFAULT_TENANT  # who it is for: its share under the fair order (core/llm/fair.py)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"sequence {self.seq_id}: the prompt must have at least one token")
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet: the whole prompt at first, then 1 per decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """KV slots this sequence can ever need: prompt + max_tokens - 1 (the last token is never fed)."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def token_ids(self, start: int, stop: int) -> list[int]:
        p = self.num_prompt_tokens
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
