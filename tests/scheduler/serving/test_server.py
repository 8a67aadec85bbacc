"""The OpenAI-compatible server, driven by the official `openai` client.

A tiny random-weight model directory (built locally, `tests/serve_model.py`)
is served on a free 127.0.0.1 port by uvicorn in a thread; every answer is
compared with an independent reference: mlx-lm's own greedy decode and
logits on a second copy of the model, the tokenizer's decode, requests run
one by one. Each server is stopped (bounded wait) when its tests end.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:  # the HTTP client the openai package uses (httpx before openai 3)
    import httpx2 as httpx  # noqa: E402
except ImportError:
    import httpx  # noqa: E402
import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from scheduler.serving.async_engine import AsyncEngine  # noqa: E402
from scheduler.serving.server import build_app  # noqa: E402
from tests.reference import greedy_reference  # noqa: E402
from tests.serve_model import load_tiny  # noqa: E402

LOOPBACK = "127.0.0.1"
MAX_TOKENS = 12


class ServerThread:
    """uvicorn on a pre-bound loopback socket, in a daemon thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@pytest.fixture
def client(served):
    server, _, _ = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def greedy_text(reference, prompt_ids, max_tokens=MAX_TOKENS):
    model, tok = reference
    tokens = greedy_reference(model, prompt_ids, max_tokens)
    return tok.decode(tokens), tokens


def wait_idle(engine, timeout=20.0):
    """Until the engine holds no request and no sequence (bounded)."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.cache.block_manager.num_sequences:
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.02)


# ---------------------------------------------------------------- tests


def test_models_health_and_metrics(served, client):
    server, _, name = served
    assert [m.id for m in client.models.list().data] == [name]
    assert httpx.get(server.url + "/health").text == "ok"
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    samples = {}
    for line in metrics.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)  # every sample line parses
    assert samples["blockmgr_kv_pages_total"] == 512
    info = 'blockmgr_cache_config_info{kv_format="model-dtype",block_size="8",num_pages="512"}'
    assert samples[info] == 1
    for family in ("requests_running", "kv_pages_used", "prefix_cache_hit_rate",
                   'time_to_first_token_seconds_bucket{le="+Inf"}', "preemptions_total"):
        assert f"blockmgr_{family}" in samples


def test_completion_greedy_matches_mlx_lm(served, client, reference):
    _, _, name = served
    _, tok = reference
    for prompt in ("Hello world", "The quick brown fox"):
        want, tokens = greedy_text(reference, tok.encode(prompt))
        got = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(tok.encode(prompt))
        assert got.usage.completion_tokens == MAX_TOKENS
    # token ids as the prompt give the same
    ids = tok.encode("Hello world")
    got = client.completions.create(model=name, prompt=ids, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == greedy_text(reference, ids)[0]


def test_chat_streaming_and_not(served, client, reference):
    _, _, name = served
    _, tok = reference
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    want, _ = greedy_text(reference, ids)
    whole = client.chat.completions.create(model=name, messages=messages, temperature=0,
                                           max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=name, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == want
    assert len(deltas) == 1 + MAX_TOKENS  # the role chunk, then one chunk per token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_stop_strings(served, client, reference):
    _, _, name = served
    _, tok = reference
    want, _ = greedy_text(reference, tok.encode("A prefix trie"), 24)
    stop = want[len(want) // 2 : len(want) // 2 + 2]
    for stream in (False, True):
        answer = client.completions.create(
            model=name, prompt="A prefix trie", max_tokens=24, temperature=0, stop=[stop],
            stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(answer)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert text == want[: want.find(stop)]
        assert reason == "stop"


def test_n_samples(served, client, reference):
    _, _, name = served
    _, tok = reference
    want, _ = greedy_text(reference, tok.encode("Hello world"))
    greedy = client.completions.create(model=name, prompt="Hello world", n=2, temperature=0,
                                       max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert [c.index for c in greedy.choices] == [0, 1]
    assert [c.text for c in greedy.choices] == [want, want]
    assert greedy.usage.completion_tokens == 2 * MAX_TOKENS
    sampled = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], n=3, temperature=1.5,
        seed=7, max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
    texts = {}
    for chunk in sampled:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1, 2]
    assert len(set(texts.values())) > 1  # three different samples


def test_several_prompts_per_completion_request(served, client, reference):
    """OpenAI's list of prompts: choice k * n + i is prompt k's sample i;
    usage sums over prompts; streaming interleaves them by index."""
    _, engine, name = served
    _, tok = reference
    prompts = ["Hello world", "The quick brown fox"]
    wants = [greedy_text(reference, tok.encode(p))[0] for p in prompts]
    whole = client.completions.create(model=name, prompt=prompts, n=2, temperature=0,
                                      max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [wants[0], wants[0], wants[1], wants[1]]
    assert whole.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert whole.usage.completion_tokens == 4 * MAX_TOKENS
    ids = [tok.encode(p) for p in reversed(prompts)]
    stream = client.completions.create(model=name, prompt=ids, temperature=0, stream=True,
                                       max_tokens=MAX_TOKENS,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, usage = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert texts == {0: wants[1], 1: wants[0]}
    assert usage.completion_tokens == 2 * MAX_TOKENS
    assert usage.prompt_tokens == sum(map(len, ids))
    wait_idle(engine)
    engine.check_integrity()


def test_a_bad_prompt_in_a_list_queues_none_of_them(served):
    """The second prompt is out of the vocabulary: 400, and nothing was
    queued (every prompt is checked before the first is added)."""
    server, engine, name = served
    before = _aborted_count(server)
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": name, "prompt": [[1, 2, 3], [1, 10**6]], "max_tokens": 50})
    assert r.status_code == 400, r.text
    assert "prompt_tokens" in r.json()["error"]["message"]
    wait_idle(engine)
    assert _aborted_count(server) == before
    engine.check_integrity()
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": name, "prompt": ["a", ""], "max_tokens": 2})
    assert r.status_code == 400 and "non-empty" in r.json()["error"]["message"]
    assert _aborted_count(server) == before  # refused before anything was queued


def _log_softmax(row):
    row = np.asarray(row, dtype=np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_logprobs_are_log_softmax_of_mlx_lm_logits(served, client, reference):
    _, _, name = served
    model, tok = reference
    prompt = tok.encode("Streams of tokens")
    _, tokens = greedy_text(reference, prompt, 6)
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 :]
    rows = [_log_softmax(np.array(logits[i])) for i in range(6)]
    got = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in tokens]
    np.testing.assert_allclose(lp.token_logprobs, [r[t] for r, t in zip(rows, tokens)],
                               atol=1e-4)
    for top, row in zip(lp.top_logprobs, rows):
        best = np.argsort(-row)[:3]
        # the legacy format keys by token text: tokens that decode alike share a key
        texts = [tok.decode([int(t)]) for t in best]
        assert set(top) == set(texts)
        for text, value in top.items():
            assert any(value == pytest.approx(row[t], abs=1e-4)
                       for t, x in zip(best, texts) if x == text)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    streamed = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0,
                                         logprobs=3, stream=True, extra_body={"ignore_eos": True})
    tokens_s, offsets_s, values_s = [], [], []
    for chunk in streamed:
        part = chunk.choices[0].logprobs
        tokens_s += part.tokens
        offsets_s += part.text_offset
        values_s += part.token_logprobs
    assert tokens_s == lp.tokens and offsets_s == lp.text_offset
    np.testing.assert_allclose(values_s, lp.token_logprobs, atol=1e-6)
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    ids = list(tok.apply_chat_template([{"role": "user", "content": "x"}],
                                       add_generation_prompt=True))
    _, tokens = greedy_text(reference, ids, 4)
    logits = model(mx.array([ids + tokens]))[0, len(ids) - 1 :]
    assert [c.token for c in content] == [tok.decode([t]) for t in tokens]
    for c, i, t in zip(content, range(4), tokens):
        row = _log_softmax(np.array(logits[i]))
        assert c.logprob == pytest.approx(row[t], abs=1e-4)
        best = np.argsort(-row)[:2]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(row[best].tolist(), abs=1e-4)


def test_usage_reports_cached_prefix_tokens(served, client, reference):
    _, engine, name = served
    _, tok = reference
    system = "Paged attention keeps the cache in fixed size blocks. " * 3
    first = tok.encode(system + "Hello world")
    second = tok.encode(system + "Numbers and symbols")
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    a = client.completions.create(model=name, prompt=first, max_tokens=2, temperature=0)
    b = client.completions.create(model=name, prompt=second, max_tokens=2, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == common
    assert common > 16


def _aborted_count(server) -> int:
    metrics = httpx.get(server.url + "/metrics").text
    key = 'blockmgr_requests_finished_total{reason="finished_aborted"} '
    lines = [line for line in metrics.splitlines() if line.startswith(key)]
    return int(lines[0].split()[-1]) if lines else 0


def wait_aborted(server, count: int, timeout: float = 10.0) -> None:
    """Until /metrics counts `count` aborted requests (the engine thread
    counts an abort just after the scheduler let it go)."""
    deadline = time.monotonic() + timeout
    while _aborted_count(server) != count:
        assert time.monotonic() < deadline, f"aborted {_aborted_count(server)}, not {count}"
        time.sleep(0.02)


def test_client_disconnect_aborts_and_frees_pages(served):
    server, engine, name = served
    wait_idle(engine)
    free = engine.cache.num_free_blocks + engine.cache.num_cached_blocks
    aborted = _aborted_count(server)
    generated = engine.stats.num_generated_tokens
    body = {"model": name, "prompt": "Hello world", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in seen)
    wait_idle(engine)
    wait_aborted(server, aborted + 1)
    assert engine.stats.num_generated_tokens - generated < 3000  # stopped early
    assert engine.cache.num_free_blocks + engine.cache.num_cached_blocks == free
    engine.check_integrity()


def test_client_disconnect_while_waiting_for_a_whole_answer(served):
    server, engine, name = served
    wait_idle(engine)
    aborted = _aborted_count(server)
    body = {"model": name, "prompt": "Hello world", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    wait_idle(engine)
    wait_aborted(server, aborted + 1)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"prompt": "hi", "temperature": -1}).encode(), "temperature"),
        (json.dumps({"prompt": "hi", "n": 0}).encode(), "n must be"),
        (json.dumps({"prompt": "hi", "logprobs": 9}).encode(), "logprobs"),
        (json.dumps({"prompt": "hi", "stop": [3]}).encode(), "stop"),
        (json.dumps({"prompt": "hi", "logit_bias": {"99999": 1}}).encode(), "logit_bias"),
        (json.dumps({"prompt": "", "max_tokens": 3}).encode(), "prompt"),
        (json.dumps({"prompt": [1, -2]}).encode(), "negative"),
        (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "stream"),
    ],
)
def test_malformed_completion_gets_400_and_the_server_keeps_serving(served, body, message):
    server, engine, name = served
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": name, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_malformed_chat_through_the_client(served, client):
    _, _, name = served
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=name, messages=[{"content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=50)
    with pytest.raises(openai.BadRequestError, match="cannot start with a tool"):
        client.chat.completions.create(model=name, messages=[{"role": "tool", "content": "x",
                                                               "tool_call_id": "1"}])
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    ok = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}],
                                        max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_concurrent_requests_equal_the_same_run_one_by_one(served, client):
    _, engine, name = served
    prompts = ["Hello world", "The quick brown", "A prefix", "Streams of text",
               "Numbers 0 1 2", "Paged attention", "hello client", "lazy dog"]

    def ask(prompt):
        return client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text

    one_by_one = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == one_by_one
    engine.check_integrity()


class GatedModel:
    """The model, with a gate its forward waits at (the engine thread then
    stays inside a step); every other attribute is the model's."""

    def __init__(self, model) -> None:
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(timeout=30), "gate never opened"
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_full_queue_answers_429_and_then_serves(model_dir):
    """With the engine thread held inside a step, requests beyond
    `max_waiting` get 429 at once; the queued ones finish when it goes on."""
    from scheduler.engine.engine import Engine

    model, tok = load_tiny(model_dir)
    gated = GatedModel(model)
    engine = Engine(gated, num_blocks=64, block_size=8, tokenizer=tok, max_num_seqs=1)
    async_engine = AsyncEngine(engine, max_waiting=1)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with ServerThread(build_app(async_engine, "tiny")) as server:
        gated.entered.clear()
        gated.gate.clear()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, server.url + "/v1/completions", json=body,
                                timeout=60)
            assert gated.entered.wait(timeout=30)  # the engine thread is in a forward
            second = pool.submit(httpx.post, server.url + "/v1/completions", json=body,
                                 timeout=60)
            deadline = time.monotonic() + 10
            while async_engine.num_pending < 1:
                assert time.monotonic() < deadline and not second.done()
                time.sleep(0.01)
            third = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert third.status_code == 429
            assert "waiting" in third.json()["error"]["message"]
            gated.gate.set()
            assert first.result().status_code == 200
            assert second.result().status_code == 200
            assert first.result().json()["choices"][0]["text"] == \
                second.result().json()["choices"][0]["text"]
        metrics = httpx.get(server.url + "/metrics").text
        assert "blockmgr_requests_rejected_total 1" in metrics
        wait_idle(engine)
