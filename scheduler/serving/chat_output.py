"""A chat answer's text split into reasoning, content and tool calls.

`ChatOutput` follows one sample's text as it streams (`feed(delta)`, then
`finish()`), and gives each time a `ChatDelta`: the reasoning text (between
the model's thinking markers, e.g. Qwen3's ``<think>``/``</think>``), the
content, and the tool calls completed so far as OpenAI's objects.

How tool calls are read depends on `tool_choice` (`ToolMode`):

* AUTO: in the model family's own format, between its start and end
  markers, parsed by mlx-lm's parser for that family (`mlx_lm.tool_parsers`,
  which `mlx_lm.load` picks from the chat template); a call is given whole
  when its end marker arrives. A call that does not parse stays content.
* NAMED (a named function): the whole text is that function's arguments
  (the server constrains it to the function's parameter schema), streamed
  as argument deltas, vLLM's way.
* REQUIRED: the whole text is a JSON array of {"name", "parameters"}
  (constrained by the server to the tools' schemas), given at the end.
* NONE: no tool call is read; everything that is not reasoning is content.

Text that could still be the start of a marker is held back until it is
known not to be one, so no delta holds part of a marker. Cost: O(length of
the delta x number of markers) per delta.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: mlx-lm's tool parser signature: (text between the markers, tools) -> call(s).
ToolParser = Callable[[str, Any], Any]


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A model family's tool-call markers and parser (mlx-lm's)."""

    start: str
    end: str
    parse: ToolParser


@dataclass(slots=True)
class ChatDelta:
    """What one `feed` or `finish` adds: OpenAI's message fields."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # whole calls, or NAMED's pieces

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    """One sample's answer (see the module doc).

    `think`: the (start, end) reasoning markers, None for a model without;
    `in_reasoning`: the prompt left the model inside its reasoning (its last
    start marker after its last end marker). `tools` is the request's tool
    list (the parsers read parameter types from it); `function` the named
    function of NAMED."""

    def __init__(self, mode: ToolMode, *, think: tuple[str, str] | None = None,
                 in_reasoning: bool = False, tool_format: ToolFormat | None = None,
                 tools: Sequence[Any] | None = None, function: str | None = None) -> None:
        self.mode = mode
        self._think = think
        self._reasoning = in_reasoning and think is not None
        self._format = tool_format if mode is ToolMode.AUTO else None
        self._tools = tools
        self._function = function
        self._pending = ""  # text not yet given out (may hold the start of a marker)
        self._call: str | None = None  # inside a family-format call: its text so far
        self._body = ""  # NAMED / REQUIRED: the whole constrained text
        self._named_started = False
        self.num_tool_calls = 0

    def feed(self, text: str) -> ChatDelta:
        delta = ChatDelta()
        self._pending += text
        self._advance(delta, final=False)
        return delta

    def finish(self) -> ChatDelta:
        """The sample ended: give out what was held back, and the calls of
        REQUIRED (a call cut short by max_tokens stays content)."""
        delta = ChatDelta()
        self._advance(delta, final=True)
        if self._call is not None:  # a family-format call never closed
            delta.content += self._format.start + self._call if self._format else self._call
            self._call = None
        if self.mode is ToolMode.REQUIRED and self._body:
            calls = _required_calls(self._body)
            if calls is None:
                delta.content += self._body
            else:
                delta.tool_calls.extend(self._numbered(calls))
        return delta

    # ------------------------------------------------------------ internals

    def _markers(self) -> list[str]:
        """The markers that can come next in the current state."""
        if self._reasoning:
            return [self._think[1]] if self._think else []
        if self._call is not None:
            return [self._format.end] if self._format else []
        markers = []
        if self._think is not None:
            markers.append(self._think[0])
        if self._format is not None:
            markers.append(self._format.start)
        return markers

    def _advance(self, delta: ChatDelta, final: bool) -> None:
        while self._pending:
            markers = self._markers()
            found = [(self._pending.find(m), m) for m in markers]
            found = [(i, m) for i, m in found if i >= 0]
            if found:
                index, marker = min(found)
                self._emit(delta, self._pending[:index])
                self._pending = self._pending[index + len(marker):]
                self._switch(delta, marker)
                continue
            keep = 0 if final else _held_back(self._pending, markers)
            self._emit(delta, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return

    def _switch(self, delta: ChatDelta, marker: str) -> None:
        if self._reasoning:
            self._reasoning = False
        elif self._call is not None:
            self._close_call(delta)
        elif self._think is not None and marker == self._think[0]:
            self._reasoning = True
        else:
            self._call = ""

    def _emit(self, delta: ChatDelta, text: str) -> None:
        if not text:
            return
        if self._reasoning:
            delta.reasoning += text
        elif self._call is not None:
            self._call += text
        elif self.mode is ToolMode.NAMED:
            self._body += text
            delta.tool_calls.append(self._named_piece(text))
        elif self.mode is ToolMode.REQUIRED:
            self._body += text
        else:
            delta.content += text

    def _named_piece(self, text: str) -> dict:
        """A streamed piece of the NAMED call: the first names it."""
        if self._named_started:
            return {"index": 0, "function": {"arguments": text}}
        self._named_started = True
        self.num_tool_calls = 1
        return {"index": 0, "id": new_call_id(), "type": "function",
                "function": {"name": self._function, "arguments": text}}

    def _close_call(self, delta: ChatDelta) -> None:
        text, self._call = self._call or "", None
        try:
            parsed = self._format.parse(text, self._tools) if self._format else None
        except Exception:  # noqa: BLE001 - a call the model got wrong stays content
            parsed = None
        calls: list[Any] = parsed if isinstance(parsed, list) else [parsed]
        if parsed is None or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                     for c in calls):
            delta.content += self._format.start + text + self._format.end \
                if self._format else text
            return
        delta.tool_calls.extend(self._numbered(
            (c["name"], c.get("arguments", {})) for c in calls))

    def _numbered(self, calls) -> list[dict]:
        out = []
        for name, arguments in calls:
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            out.append({"index": self.num_tool_calls, "id": new_call_id(), "type": "function",
                        "function": {"name": name, "arguments": arguments}})
            self.num_tool_calls += 1
        return out


def _held_back(text: str, markers: list[str]) -> int:
    """Characters at the end of `text` that could begin a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _required_calls(text: str) -> list[tuple[str, Any]] | None:
    """REQUIRED's text: a JSON array of {"name", "parameters"} (None if not)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [(i["name"], i.get("parameters", {})) for i in items]
