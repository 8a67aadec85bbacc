"""The agent API through the official `openai` client: tool calls, JSON
output, reasoning and template keywords, on the tiny agent model
(`tests/serve_model.build_agent_model_dir`: its head prefers the tokens that
close JSON, and a logit bias on `<tool_call>` or `<think>` forces a chain).

Every answer is checked against an independent reference: `json.loads` and
`jsonschema.validate` of the text, the tokenizer's own chat template for the
prompt length, the forced chain's known text.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from blockmgr.errors import InvalidArgument  # noqa: E402
from scheduler.core.constraints import GrammarError, Grammars  # noqa: E402
from scheduler.core.request import RequestStatus, SamplingParams  # noqa: E402
from scheduler.engine.engine import Engine  # noqa: E402
from scheduler.serving.async_engine import AsyncEngine  # noqa: E402
from scheduler.serving.serve import load_engine, serve_config  # noqa: E402
from scheduler.serving.server import build_app  # noqa: E402
from tests.scheduler.serving.test_server import ServerThread, wait_idle  # noqa: E402
from tests.serve_model import ANSWER, CALL, REASONING, THINK, build_agent_model_dir, load_tiny  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": ["string", "null"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
STRICT = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["a", "b"]}, "size": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "inner": {"$ref": "#/$defs/inner"}},
    "required": ["name", "tags", "kind", "size", "inner"], "additionalProperties": False,
    "$defs": {"inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    return build_agent_model_dir(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="module")
def served(agent_dir):
    engine, name = load_engine(agent_dir, serve_config(num_blocks=512, block_size=8))
    with ServerThread(build_app(AsyncEngine(engine, max_waiting=64), name)) as server:
        yield server, engine, name


@pytest.fixture
def client(served):
    server, _, _ = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def _token(agent_dir, text):
    _, tok = load_tiny(agent_dir)
    return tok.convert_tokens_to_ids(text)


def _check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function"
        assert names is None or call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])


def _streamed_calls(client, **kwargs):
    """(tool calls merged from the deltas, finish reason) of a stream."""
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": None, "arguments": "", "id": None})
                if piece.id:
                    call["id"] = piece.id
                if piece.function.name:
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[k] for k in sorted(calls)], reason


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required_returns_valid_calls(served, client, seed):
    answer = client.chat.completions.create(
        model=served[2], messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, SCHEMAS)
    calls, reason = _streamed_calls(client, model=served[2], messages=MESSAGES, tools=TOOLS,
                                    tool_choice="required", max_tokens=MAX_TOKENS,
                                    temperature=1.0, seed=seed)
    assert reason == "tool_calls" and calls
    for call in calls:
        assert call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    wait_idle(served[1])


@pytest.mark.parametrize("seed", range(3))
def test_named_tool_choice_returns_that_function(served, client, seed):
    choice_field = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=served[2], messages=MESSAGES, tools=TOOLS, tool_choice=choice_field,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    _check_calls(calls)
    streamed, _ = _streamed_calls(client, model=served[2], messages=MESSAGES, tools=TOOLS,
                                  tool_choice=choice_field, max_tokens=MAX_TOKENS,
                                  temperature=1.0, seed=seed)
    assert [c["name"] for c in streamed] == ["get_weather"]
    # the same seed draws the same tokens, streamed or not
    assert streamed[0]["arguments"] == calls[0].function.arguments


@pytest.mark.parametrize("seed", range(20))
def test_json_schema_strict_parses_and_validates(served, client, seed):
    answer = client.chat.completions.create(
        model=served[2], messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {
            "name": "thing", "strict": True, "schema": STRICT}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), STRICT)


def test_json_object_returns_an_object(served, client):
    for stream in (False, True):
        kwargs = dict(model=served[2], messages=MESSAGES, max_tokens=MAX_TOKENS,
                      temperature=1.0, seed=7, response_format={"type": "json_object"})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert isinstance(json.loads(text), dict)
    completion = client.completions.create(model=served[2], prompt="Hello", seed=3,
                                           max_tokens=MAX_TOKENS, temperature=1.0,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_family_format_call_forced_by_logit_bias_is_parsed(served, client, agent_dir):
    bias = {str(_token(agent_dir, CALL)): 100}
    answer = client.chat.completions.create(model=served[2], messages=MESSAGES, tools=TOOLS,
                                            max_tokens=8, temperature=0, logit_bias=bias)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    calls, reason = _streamed_calls(client, model=served[2], messages=MESSAGES, tools=TOOLS,
                                    max_tokens=8, temperature=0, logit_bias=bias)
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    # tool_choice "none": the same text is content, no call is read
    plain = client.chat.completions.create(model=served[2], messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=8, temperature=0,
                                           logit_bias=bias)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith(CALL)


def test_reasoning_is_split_streamed_and_not(served, client, agent_dir):
    bias = {str(_token(agent_dir, THINK)): 100}
    answer = client.chat.completions.create(model=served[2], messages=MESSAGES, max_tokens=8,
                                            temperature=0, logit_bias=bias)
    message = answer.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == REASONING
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=served[2], messages=MESSAGES,
                                                max_tokens=8, temperature=0, logit_bias=bias,
                                                stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_chat_template_kwargs_reach_the_template(served, client, agent_dir):
    _, tok = load_tiny(agent_dir)
    for kwargs in ({}, {"enable_thinking": False}):
        expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
        answer = client.chat.completions.create(model=served[2], messages=MESSAGES,
                                                max_tokens=1, temperature=0,
                                                extra_body={"chat_template_kwargs": kwargs})
        assert answer.usage.prompt_tokens == len(expected)
    # the tools are rendered too
    with_tools = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    answer = client.chat.completions.create(model=served[2], messages=MESSAGES, tools=TOOLS,
                                            max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens == len(with_tools)


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "schema"),
    ({"chat_template_kwargs": {"tokenize": False}}, "may not set tokenize"),
])
def test_bad_agent_fields_get_400(served, client, body, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=served[2], messages=MESSAGES, max_tokens=4,
                                       extra_body=body)
    assert message in str(error.value)
    wait_idle(served[1])


def test_without_llguidance_constrained_fields_get_400(served, client, monkeypatch):
    monkeypatch.setattr(Grammars, "available", staticmethod(lambda: False))
    for body in ({"response_format": {"type": "json_object"}},
                 {"tools": TOOLS, "tool_choice": "required"}):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=served[2], messages=MESSAGES, max_tokens=4,
                                           extra_body=body)
        assert "mlx-blockmgr[structured]" in str(error.value)
    # the other agent fields need no grammar
    answer = client.chat.completions.create(model=served[2], messages=MESSAGES, tools=TOOLS,
                                            max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")
    wait_idle(served[1])


class _RaisingMatcher:
    def allowed(self, output):
        if len(output) >= 2:
            raise GrammarError("injected matcher fault")
        return _FirstAllowed.mask


class _FirstAllowed:
    mask = None


class _RaisingConstraint:
    def new_matcher(self):
        return _RaisingMatcher()


def test_a_raising_matcher_fails_its_request_only(agent_dir):
    """A grammar fault aborts its request with the error; the others equal
    their solo runs and nothing is leaked."""
    import numpy as np

    model, tok = load_tiny(agent_dir)
    _FirstAllowed.mask = np.full((len(tok) + 31) // 32, -1, dtype=np.int32)
    engine = Engine(model, num_blocks=128, block_size=8, tokenizer=tok)
    grammar = engine.grammars.json_schema(STRICT)
    prompts = [tok.encode(t) for t in ("Hello world", "The quick brown fox", "Paged")]
    good = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4, constraint=grammar)
    solo = [engine.generate([p], good)[0] for p in prompts]
    bad = SamplingParams(max_tokens=MAX_TOKENS, constraint=_RaisingConstraint())
    outs = engine.generate(prompts + [prompts[0]], [good, good, good, bad])
    for out, alone in zip(outs, solo):
        assert out.tokens == alone.tokens
        jsonschema.validate(json.loads(out.text), STRICT)
    assert outs[3].finish_reasons == [RequestStatus.FINISHED_ABORTED]
    assert len(outs[3].tokens) == 2  # the matcher raised when asked for the third token
    assert engine.cache.block_manager.num_sequences == 0
    engine.check_integrity()
    with pytest.raises(InvalidArgument):
        SamplingParams(constraint=object())


def test_constrained_rows_are_not_speculated(agent_dir):
    """With a draft model, a constrained request draws what it draws without
    one (the same seed), and its text validates; a plain request beside it
    is still speculated."""
    model, tok = load_tiny(agent_dir)
    draft, _ = load_tiny(agent_dir)
    plain_engine = Engine(model, num_blocks=128, block_size=8, tokenizer=tok)
    spec_engine = Engine(model, num_blocks=128, block_size=8, tokenizer=tok, draft_model=draft,
                         num_speculative_tokens=3)
    prompt = tok.encode("Hello world")
    outs = {}
    for engine in (plain_engine, spec_engine):
        grammar = engine.grammars.json_schema(STRICT)
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9,
                                 constraint=grammar),
                  SamplingParams(max_tokens=16, temperature=0)]
        outs[engine] = engine.generate([prompt, prompt], params)
    assert outs[spec_engine][0].tokens == outs[plain_engine][0].tokens
    jsonschema.validate(json.loads(outs[spec_engine][0].text), STRICT)
    assert outs[spec_engine][1].tokens == outs[plain_engine][1].tokens
    assert spec_engine.stats.num_draft_tokens > 0
    spec_engine.check_integrity()
