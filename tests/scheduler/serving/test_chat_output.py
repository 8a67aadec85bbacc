"""`ChatOutput`: an answer split into reasoning, content and tool calls the
same way whether its text comes whole or one character at a time (markers
cut anywhere), against the known parts of a hand-written answer."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from scheduler.serving.chat_output import ChatOutput, ToolFormat, ToolMode

FORMAT = ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end,
                    json_tools.parse_tool_call)
THINK = ("<think>", "</think>")
ANSWER = ('<think>let me see < think</think>It is <b>warm</b>. '
          '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
          '<tool_call>not json</tool_call> done <tool')


def _run(parser: ChatOutput, pieces: list[str]) -> tuple[str, str, list[dict]]:
    reasoning, content, calls = "", "", []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        calls += delta.tool_calls
    return reasoning, content, calls


@pytest.mark.parametrize("size", [len(ANSWER), 1, 3, 7])
def test_auto_splits_reasoning_content_and_calls(size):
    parser = ChatOutput(ToolMode.AUTO, think=THINK, tool_format=FORMAT)
    pieces = [ANSWER[i:i + size] for i in range(0, len(ANSWER), size)]
    reasoning, content, calls = _run(parser, pieces)
    assert reasoning == "let me see < think"
    assert content == "It is <b>warm</b>. <tool_call>not json</tool_call> done <tool"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "f", {"a": 1})]
    assert parser.num_tool_calls == 1


def test_none_reads_no_call_and_a_prompt_may_start_in_reasoning():
    parser = ChatOutput(ToolMode.NONE, think=THINK, tool_format=FORMAT, in_reasoning=True)
    reasoning, content, calls = _run(parser, ["abc</thi", "nk><tool_call>{}</tool_call>"])
    assert (reasoning, content, calls) == ("abc", "<tool_call>{}</tool_call>", [])


def test_required_and_named():
    required = ChatOutput(ToolMode.REQUIRED)
    _, content, calls = _run(required, ['[{"name": "f", "param', 'eters": {"x": 2}}]'])
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("f", {"x": 2})]
    named = ChatOutput(ToolMode.NAMED, function="g")
    _, content, pieces = _run(named, ['{"y"', ': 3}'])
    assert content == "" and pieces[0]["function"]["name"] == "g" and pieces[0]["id"]
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"y": 3}'
