"""How the engine's outputs become OpenAI answers: choices, usage, logprobs, tool calls, SSE chunks.

    Answer                  one sequence's outputs, collected (text, the outputs, the last one)
    collect(req, first)     -> Answer
    usage_of(answers, n)    OpenAI's ``usage``: each prompt counted once, every sample's completion
    best(answers, n)        the ``n`` of a prompt's ``best_of`` samples with the highest total logprob
    completion_choice / chat_choice     one choice of a whole answer
    Chunks                  the SSE chunks of a streamed answer: completions or chat, any number of
                            choices (``n``, several prompts), logprobs and tool calls per chunk

Logprobs are OpenAI's two shapes: completions ``{tokens, token_logprobs, top_logprobs, text_offset}``,
chat ``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``; a token's text is its id decoded
alone with special tokens shown (``TokenText``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import orjson

from batchpilot.runtime.llm.engine import GenerationOutput, GenerationStream
from batchpilot.server.llm.tools import ToolPlan, ToolStream


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    """OpenAI's ``usage`` of one answer; ``prompt_tokens_details`` only when the prefix cache served
    part of the prompt."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[PromptTokensDetails]


def sse(obj: dict[str, object] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``). orjson: a stream encodes one
    chunk per token, on the event loop."""
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"


@dataclass
class Answer:
    text: str
    outputs: list[GenerationOutput]

    @property
    def last(self) -> GenerationOutput:
        return self.outputs[-1]

    @property
    def total_logprob(self) -> float:
        return sum(o.logprob or 0.0 for o in self.outputs)


async def collect(req: GenerationStream, first: GenerationOutput | None = None) -> Answer:
    outputs = [] if first is None else [first]
    if first is None or first.finish_reason is None:
        async for item in req:
            outputs.append(item)
    return Answer("".join(o.text for o in outputs), outputs)


def usage_of(lasts: Sequence[GenerationOutput], samples: int = 1) -> Usage:
    """The usage of a request's sequences (``samples`` per prompt, in prompt order): each prompt's
    tokens once, every sequence's output tokens; cached tokens only for a single sequence."""
    prompt = sum(last.num_prompt_tokens for last in lasts[::samples])
    completion = sum(last.num_output_tokens for last in lasts)
    usage: Usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion}
    if len(lasts) == 1 and lasts[0].num_cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": lasts[0].num_cached_tokens}
    return usage


def best(answers: list[Answer], n: int) -> list[Answer]:
    """The ``n`` answers with the highest total logprob, in the order they were sampled."""
    keep = sorted(range(len(answers)), key=lambda i: -answers[i].total_logprob)[:n]
    return [answers[i] for i in sorted(keep)]


class TokenText:
    """A token id's text as logprobs show it: decoded alone, special tokens included (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.text = functools.lru_cache(maxsize=1 << 16)(
            lambda i: str(tokenizer.decode([i], skip_special_tokens=False)))

    def __call__(self, token: int) -> str:
        return self.text(token)


def completion_logprobs(outputs: Sequence[GenerationOutput], text: TokenText, offset: int = 0
                        ) -> dict[str, list[Any]]:
    tokens, lps, tops, offsets = [], [], [], []
    for o in outputs:
        tokens.append(text(o.token_ids[0]))
        lps.append(o.logprob)
        tops.append({text(i): lp for i, lp in o.top_logprobs} or None)
        offsets.append(offset)
        offset += len(o.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(outputs: Sequence[GenerationOutput], text: TokenText) -> dict[str, list[Any]]:
    def entry(token: int, lp: float | None) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(o.token_ids[0], o.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in o.top_logprobs]} for o in outputs]}


def completion_choice(index: int, a: Answer, text: TokenText | None) -> dict[str, object]:
    return {"index": index, "text": a.text, "finish_reason": a.last.finish_reason,
            "logprobs": None if text is None else completion_logprobs(a.outputs, text)}


def chat_choice(index: int, a: Answer, text: TokenText | None, tools: ToolPlan | None) -> dict[str, object]:
    message: dict[str, object] = {"role": "assistant", "content": a.text}
    reason = a.last.finish_reason
    calls = tools.calls(a.text) if tools is not None else None
    if calls is not None:
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        reason = "tool_calls" if reason == "stop" else reason
    return {"index": index, "message": message, "finish_reason": reason,
            "logprobs": None if text is None else chat_logprobs(a.outputs, text)}


# -- Streams -----------------------------------------------------------------------------------------

async def merged(firsts: Sequence[GenerationOutput], reqs: Sequence[GenerationStream]
                 ) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Every request's outputs as they come, tagged with its index; each one's primed first output
    first. A failure of any request ends the stream with it."""
    import asyncio

    queue: asyncio.Queue[tuple[int, GenerationOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerationStream) -> None:
        try:
            async for item in req:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    for i, first in enumerate(firsts):
        yield i, first
    live = [i for i, f in enumerate(firsts) if f.finish_reason is None]
    tasks = [asyncio.ensure_future(pump(i, reqs[i])) for i in live]
    try:
        left = len(live)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Chunks:
    """The SSE body of a streamed answer. ``chat``: chat chunks (a role delta opens each choice);
    else completion chunks. ``text``: show logprobs; ``tools``: each choice is a tool call."""

    head: dict[str, object]
    chat: bool
    text: TokenText | None = None
    tools: ToolPlan | None = None
    include_usage: bool = False
    samples: int = 1
    _offsets: dict[int, int] = field(default_factory=dict)
    _calls: dict[int, ToolStream] = field(default_factory=dict)

    async def events(self, firsts: Sequence[GenerationOutput], reqs: Sequence[GenerationStream],
                     on_finish: Callable[[GenerationOutput], None]) -> AsyncIterator[bytes]:
        lasts: dict[int, GenerationOutput] = {}
        if self.chat:
            for i in range(len(reqs)):
                yield self._chunk(i, {"role": "assistant", "content": "" if self.tools is None else None},
                                  None, None)
        async for i, item in merged(firsts, reqs):
            lasts[i] = item
            body = self._delta(i, item)
            if body is not None:
                yield body
            if item.finish_reason is not None:
                on_finish(item)
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": usage_of([lasts[i] for i in sorted(lasts)],
                                                                     self.samples)})
        yield sse("[DONE]")

    def _delta(self, i: int, item: GenerationOutput) -> bytes | None:
        reason = item.finish_reason
        if not self.chat:
            lp = None
            if self.text is not None:
                lp = completion_logprobs([item], self.text, self._offsets.get(i, 0))
                self._offsets[i] = self._offsets.get(i, 0) + len(item.text)
            return sse({**self.head, "choices": [{"index": i, "text": item.text, "logprobs": lp,
                                                   "finish_reason": reason}]})
        lp = chat_logprobs([item], self.text) if self.text is not None else None
        if self.tools is None:
            if not item.text and reason is None and lp is None:
                return None
            delta: dict[str, object] = {"content": item.text} if item.text else {}
            return self._chunk(i, delta, reason, lp)
        calls = self._calls.setdefault(i, self.tools.stream())
        parts = calls.feed(item.text) + (calls.finish() if reason is not None else [])
        if reason == "stop" and calls.started:
            reason = "tool_calls"
        if not parts and reason is None and lp is None:
            return None
        return self._chunk(i, {"tool_calls": parts} if parts else {}, reason, lp)

    def _chunk(self, i: int, delta: dict[str, object], reason: str | None, lp: object) -> bytes:
        return sse({**self.head, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                               "finish_reason": reason}]})


def first_token_timing(received: float, first: GenerationOutput) -> dict[str, str]:
    """W3C ``Server-Timing`` of a stream's first token (the headers leave with it): ``tokenize`` = the
    handler's start -> the sequence in the engine (prompt encoding), ``engine`` = the engine's TTFT
    (queue, prefill, first token out of its step), ``app`` = the handler's start -> that token back on
    the event loop. ``app - tokenize - engine`` is the hand-off from the engine thread to the loop;
    the client's TTFT minus ``app`` is HTTP both ways (the load generator records each part)."""
    now = time.monotonic()
    return {"server-timing": f"tokenize;dur={max(first.arrival - received, 0.0) * 1e3:.3f}, "
                             f"engine;dur={max(first.emitted - first.arrival, 0.0) * 1e3:.3f}, "
                             f"app;dur={(now - received) * 1e3:.3f}"}
