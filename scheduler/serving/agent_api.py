"""The agent fields of a chat or completions body: `tools`, `tool_choice`,
`response_format`, `chat_template_kwargs` (`AgentOptions.of`).

* `tools` go to the chat template (`text.ChatPrompt`), as mlx-lm and vLLM
  give them; `chat_template_kwargs` too (e.g. {"enable_thinking": false}).
* `tool_choice`: "none" (tools rendered, no call read), "auto" (calls read
  in the model family's format: `chat_output`), "required" and a named
  function: the answer is constrained by a grammar (`constraints`) to a
  JSON array of calls / the function's arguments, vLLM's way, so even a
  weak model returns a call whose arguments validate.
* `response_format`: "text", "json_object", "json_schema" (its `schema`;
  strict or not, the grammar enforces it), by constrained decoding.

Constraints need the `structured` extra (llguidance); without it those
requests are refused (`GrammarUnavailable`, a 400), and nothing else
changes. Every malformed field is an `InvalidArgument` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from blockmgr.errors import InvalidArgument
from scheduler.core.constraints import Constraint, Grammars, GrammarUnavailable
from scheduler.serving.chat_output import ChatOutput, ToolFormat, ToolMode


@runtime_checkable
class AgentTokenizer(Protocol):
    """What mlx-lm's `TokenizerWrapper` tells of a model family's tool-call
    and reasoning formats."""

    has_tool_calling: bool
    tool_call_start: str | None
    tool_call_end: str | None
    tool_parser: Any
    has_thinking: bool
    think_start: str | None
    think_end: str | None

    def rfind_think_start(self, tokens: list[int]) -> int: ...
    def rfind_think_end(self, tokens: list[int]) -> int: ...


@dataclass(frozen=True, slots=True)
class AgentOptions:
    mode: ToolMode = ToolMode.NONE
    tools: list[dict] | None = None
    function: str | None = None  # NAMED's function
    constraint: Constraint | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, body: Mapping, chat: bool, grammars: Grammars | None) -> AgentOptions:
        """The body's agent fields, checked; grammars compiled (this can
        take a while on a first request: call it off the engine thread)."""
        tools = _tools(body.get("tools")) if chat else None
        mode, function = _tool_choice(body.get("tool_choice"), tools) if chat \
            else (ToolMode.NONE, None)
        kwargs = body.get("chat_template_kwargs") if chat else None
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise InvalidArgument("chat_template_kwargs must be an object")
        schema = _response_schema(body.get("response_format"))
        if schema is not None and mode in (ToolMode.REQUIRED, ToolMode.NAMED):
            raise InvalidArgument("response_format cannot be combined with tool_choice "
                                  f"{'required' if mode is ToolMode.REQUIRED else 'a function'}")
        if mode is ToolMode.REQUIRED:
            schema = _calls_schema(tools or [])
        elif mode is ToolMode.NAMED:
            schema = _parameters(tools or [], function)
        constraint = None
        if schema is not None:
            if grammars is None:
                raise InvalidArgument("constrained decoding needs a model with a tokenizer")
            if not Grammars.available():
                raise GrammarUnavailable(
                    "response_format and tool_choice 'required' or a named function need "
                    "constrained decoding: pip install 'mlx-blockmgr[structured]'")
            constraint = grammars.json_schema(schema)
        return cls(mode, tools, function, constraint, dict(kwargs or {}))

    def chat_output(self, tokenizer: object, prompt: list[int]) -> ChatOutput:
        """The parser of one sample's answer to `prompt`."""
        think, in_reasoning, tool_format = None, False, None
        if isinstance(tokenizer, AgentTokenizer):
            if tokenizer.has_thinking and tokenizer.think_start and tokenizer.think_end:
                think = (tokenizer.think_start, tokenizer.think_end)
                in_reasoning = tokenizer.rfind_think_start(prompt) > \
                    tokenizer.rfind_think_end(prompt)
            if tokenizer.has_tool_calling and tokenizer.tool_call_start \
                    and tokenizer.tool_call_end and tokenizer.tool_parser is not None:
                tool_format = ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end,
                                         tokenizer.tool_parser)
        if self.constraint is not None:  # the grammar starts at the first token
            in_reasoning = False
        return ChatOutput(self.mode, think=think, in_reasoning=in_reasoning,
                          tool_format=tool_format, tools=self.tools, function=self.function)


def _tools(tools: object) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list of tool objects")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" \
                or not isinstance(function, Mapping):
            raise InvalidArgument(f"tools[{index}] must be {{\"type\": \"function\", "
                                  f"\"function\": {{...}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidArgument(f"tools[{index}].function.name must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidArgument(f"tools[{index}].function.parameters must be a JSON schema")
    return [dict(t) for t in tools]


def _tool_choice(choice: object, tools: list[dict] | None) -> tuple[ToolMode, str | None]:
    if choice is None:
        return (ToolMode.AUTO if tools else ToolMode.NONE), None
    if choice in ("none", "auto", "required"):
        mode = ToolMode(choice)
        if mode is not ToolMode.NONE and not tools:
            if mode is ToolMode.AUTO:
                return ToolMode.NONE, None
            raise InvalidArgument("tool_choice 'required' needs tools")
        return mode, None
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" \
            or not isinstance(name, str):
        raise InvalidArgument("tool_choice must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if not tools or name not in [t["function"]["name"] for t in tools]:
        raise InvalidArgument(f"tool_choice names a function that is not in tools: {name!r:.80}")
    return ToolMode.NAMED, name


def _parameters(tools: Sequence[dict], name: str | None) -> dict:
    for tool in tools:
        if tool["function"]["name"] == name:
            return dict(tool["function"].get("parameters") or {"type": "object"})
    raise InvalidArgument(f"no tool named {name!r:.80}")


def _calls_schema(tools: Sequence[dict]) -> dict:
    """A JSON array of one or more {"name", "parameters"} calls of `tools`."""
    items = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "parameters": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": items}}


def _response_schema(response_format: object) -> dict | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(response_format, Mapping):
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidArgument("response_format.json_schema.schema must be a JSON schema")
        return dict(schema)
    raise InvalidArgument("response_format.type must be 'text', 'json_object' or "
                          f"'json_schema', got {kind!r:.40}")
