"""Forced tool calls on the chat route: ``tools`` with ``tool_choice`` "required" or a named function.

The call is generated under a JSON schema, like any structured output (``models/llm/grammar.py``), and
returned in OpenAI's shape (``message.tool_calls``, ``finish_reason: "tool_calls"``), streamed too:

* a named function: the answer is its ``arguments`` object, under the function's ``parameters`` schema;
* "required": the answer is ``{"name": ..., "arguments": {...}}``, under a schema that is one of the
  tools' (its ``name`` a constant and its ``arguments`` that tool's ``parameters``); the name is read
  from the answer, one call per choice.

``tool_choice: "auto"`` (the default when tools are given) would need the model's own tool-call syntax
parsed out of free text, which differs by model family: it is refused with a 400 that says what to send
instead. ``"none"`` answers in text and does not show the tools to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batchpilot.core.llm.sequence import StructuredOutput
from batchpilot.server.errors import APIError


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


def tool_plan(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> ToolPlan | None:
    """What the request's tools ask the answer to be (None: a text answer), or a 400 saying why not."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", code="invalid_value", param="tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        raise APIError(400, 'tool_choice "auto" (the default when tools are given) is not served: send '
                            'tool_choice "required" or {"type": "function", "function": {"name": ...}}, or '
                            '"none"', code="unsupported_value", param="tool_choice")
    by_name = {t.function.name: t.function for t in tools}
    if len(by_name) != len(tools):
        raise APIError(400, "tools: two functions have the same name", code="invalid_value", param="tools")
    if isinstance(choice, NamedToolChoice):
        fn = by_name.get(choice.function.name)
        if fn is None:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not one of the tools",
                           code="invalid_value", param="tool_choice")
        return ToolPlan(fn.name, {fn.name: parameters_of(fn)})
    if choice != "required":
        raise APIError(400, f'tool_choice {choice!r}: send "none", "required" or a named function',
                       code="invalid_value", param="tool_choice")
    return ToolPlan(None, {name: parameters_of(fn) for name, fn in by_name.items()})


def parameters_of(fn: FunctionDef) -> dict[str, Any]:
    return fn.parameters or {"type": "object"}


@dataclass
class ToolPlan:
    """``named``: the function the answer calls (None: the answer names one of ``schemas``)."""

    named: str | None
    schemas: dict[str, dict[str, Any]]

    def constraint(self) -> StructuredOutput:
        if self.named is not None:
            return StructuredOutput("json_schema", json.dumps(self.schemas[self.named]))
        one_of = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                   "required": ["name", "arguments"], "additionalProperties": False}
                  for name, params in self.schemas.items()]
        return StructuredOutput("json_schema", json.dumps({"anyOf": one_of}))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer's tool calls, or None when the text is not a whole call (cut at max_tokens)."""
        if self.named is not None:
            try:
                json.loads(text)
            except ValueError:
                return None
            return [call(self.named, text)]
        try:
            obj = json.loads(text)
            return [call(obj["name"], json.dumps(obj["arguments"], separators=(",", ":")))]
        except (ValueError, KeyError, TypeError):
            return None

    def stream(self) -> ToolStream:
        return ToolStream(self)


def call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": name, "arguments": arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


_HEAD = re.compile(r'^\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolStream:
    """A choice's streamed tool call: text deltas in, ``delta.tool_calls`` lists out. For "required", the
    call's head waits for the name, and the last character (the wrapper's closing brace) is held back."""

    plan: ToolPlan
    buffer: str = ""
    started: bool = False
    held: str = field(default="")

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.plan.named is not None:
            if not self.started:
                self.started = True
                out.append(call(self.plan.named, "", index=0))
            if text:
                out.append({"index": 0, "function": {"arguments": text}})
            return out
        if not self.started:
            self.buffer += text
            m = _HEAD.match(self.buffer)
            if m is None:
                return out
            self.started = True
            out.append(call(json.loads(m.group(1)), "", index=0))
            text, self.buffer = self.buffer[m.end():], ""
        text, self.held = (self.held + text)[:-1], (self.held + text)[-1:]
        if text:
            out.append({"index": 0, "function": {"arguments": text}})
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left at the end: nothing, or (a call cut short) the held character."""
        if self.plan.named is None and self.started and self.held and self.held != "}":
            return [{"index": 0, "function": {"arguments": self.held}}]
        return []
