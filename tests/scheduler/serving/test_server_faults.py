"""Nothing a client sends, and no fault, hurts another request (issue 25).

One server (uvicorn on 127.0.0.1, the official `openai` client where it
fits) over a tiny model whose context is 128 tokens, with faults that only
fire on purpose: a model whose forward raises on a poison token and can be
held inside a forward (`gate`), and a tokenizer whose decode raises on
another poison token and whose encode raises on a marker text.

Each row of the issue's table is a test. Innocent streams are in flight
while the bad request is handled (the engine thread is held in a forward
while they and the bad request are sent), and afterwards every innocent
text equals its solo run, the bad request got OpenAI's error object (or an
error event before `[DONE]`), and the pool holds nothing but the prefix
cache. Row 11 (SIGTERM) is in `tests/scheduler/serving/test_server_cli.py`.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
try:  # the HTTP client the openai package uses (httpx before openai 3)
    import httpx2 as httpx  # noqa: E402
except ImportError:
    import httpx  # noqa: E402

from scheduler import Engine  # noqa: E402
from scheduler.serving.async_engine import AsyncEngine  # noqa: E402
from scheduler.serving.serve import load_engine, model_context, serve_config  # noqa: E402
from scheduler.serving.server import MAX_STOP_LENGTH, MAX_STOP_STRINGS, build_app  # noqa: E402
from tests.polling import wait_for  # noqa: E402
from tests.scheduler.serving.test_server import LOOPBACK, ServerThread  # noqa: E402
from tests.serve_model import build_model_dir, load_tiny  # noqa: E402

CONTEXT = 128  # the model's max_position_embeddings
NUM_BLOCKS = 256
BODY_LIMIT = 256 * 1024
POISON_DECODE = 391  # the tokenizer's decode raises on a text holding it
POISON_FORWARD = 392  # the model's forward raises on an input holding it
ENCODE_FAULT = "ENCODE-FAULT"  # the tokenizer's encode raises on a text holding it
INNOCENT = ["Hello world", "The quick brown fox", "A prefix trie", "Streams of tokens",
            "Paged attention keeps"]
MAX_TOKENS = 24


class FaultyTokenizer:
    """mlx-lm's tokenizer, with a decode and an encode fault on purpose;
    records the threads that encoded."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.encode_threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text, *args, **kwargs):
        self.encode_threads.append(threading.current_thread().name)
        if ENCODE_FAULT in text:
            raise RuntimeError("injected encode fault")
        return self._tokenizer.encode(text, *args, **kwargs)

    def decode(self, tokens, *args, **kwargs):
        if POISON_DECODE in list(tokens):
            raise RuntimeError("injected decode fault")
        return self._tokenizer.decode(tokens, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.encode_threads.append(threading.current_thread().name)
        return self._tokenizer.apply_chat_template(*args, **kwargs)


class FaultyModel:
    """The model, raising on an input that holds `POISON_FORWARD`, and
    waiting at `gate` in every forward (the engine thread then stays in a step)."""

    def __init__(self, model) -> None:
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, inputs, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(timeout=60), "gate never opened"
        if mx.any(inputs == POISON_FORWARD).item():
            raise RuntimeError("injected forward fault")
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


class Served:
    def __init__(self, server, engine, async_engine, model, tokenizer) -> None:
        self.server, self.engine, self.async_engine = server, engine, async_engine
        self.model, self.tokenizer = model, tokenizer
        self.url = server.url

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("faults"), context=CONTEXT)


@pytest.fixture(scope="module")
def served(model_dir):
    model, tok = load_tiny(model_dir)
    faulty_model, faulty_tok = FaultyModel(model), FaultyTokenizer(tok)
    engine = Engine(faulty_model, num_blocks=NUM_BLOCKS, block_size=8, tokenizer=faulty_tok,
                    max_model_len=CONTEXT, prefill_batch=8)
    async_engine = AsyncEngine(engine, max_waiting=64)
    app = build_app(async_engine, "tiny", max_body_bytes=BODY_LIMIT)
    with ServerThread(app) as server:
        yield Served(server, engine, async_engine, faulty_model, faulty_tok)


def stream_text(served: Served, prompt, **extra) -> tuple[str, str | None]:
    """A streamed completion's text and last finish reason."""
    with served.client() as client:
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True, **extra})
        texts, reason = [], None
        for chunk in chunks:
            texts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
    return "".join(texts), reason


@pytest.fixture(scope="module")
def solo(served) -> list[tuple[str, str]]:
    """Each innocent prompt run alone."""
    outs = [stream_text(served, p) for p in INNOCENT]
    tok = served.tokenizer
    for prompt, (text, _) in zip(INNOCENT, outs):  # the poisons stay out of their way
        ids = tok.encode(prompt + text)
        assert POISON_DECODE not in ids and POISON_FORWARD not in ids
    return outs


def in_flight(served: Served) -> int:
    """Requests the engine holds or has been sent (read while it is held in a forward)."""
    scheduler = served.engine.scheduler
    return served.async_engine.num_pending + scheduler.num_waiting + scheduler.num_running


def together(served: Served, solo, bad, num_bad_requests: int = 0):
    """Run `bad()` while the innocent streams are in flight; returns its
    result after checking that every innocent text equals its solo run.

    The engine is held inside a forward while the innocents are sent, then
    `bad` runs: with `num_bad_requests` 0 it must be answered while the
    engine is still held (refused before anything is queued); otherwise the
    engine goes on once its `num_bad_requests` requests are sent too."""
    model = served.model
    model.entered.clear()
    model.gate.clear()
    try:
        with ThreadPoolExecutor(len(INNOCENT) + 1) as pool:
            innocents = [pool.submit(stream_text, served, p) for p in INNOCENT]
            assert model.entered.wait(timeout=30)
            wait_for(lambda: in_flight(served) >= len(INNOCENT), "the innocents were not sent")
            outcome = pool.submit(bad)
            if num_bad_requests:
                wait_for(lambda: in_flight(served) >= len(INNOCENT) + num_bad_requests
                         or outcome.done(), "the bad request was not sent")
            else:
                outcome.exception(timeout=30)  # answered with the engine held
                assert all(not f.done() for f in innocents)
            model.gate.set()
            assert [f.result(timeout=60) for f in innocents] == solo
            return outcome.result(timeout=60)
    finally:
        model.gate.set()


def assert_clean(served: Served) -> None:
    """Nothing held but the prefix cache; the storage's invariants hold."""
    engine = served.engine
    wait_for(lambda: not engine.has_unfinished() and not served.async_engine.num_pending,
             "the engine did not become idle")
    assert engine.cache.block_manager.num_sequences == 0
    assert engine.cache.num_free_blocks + engine.cache.num_cached_blocks == NUM_BLOCKS
    engine.check_integrity()


def num_ended(served: Served) -> int:
    """Requests the server queued that have ended (finished or aborted)."""
    return sum(dict(served.async_engine.metrics.finished).values())


def post(served: Served, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(served.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"}, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    """OpenAI's error object of an answer with `status`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ------------------------------------------------------------ 1 stop strings


def test_row1_huge_stop_lists_are_refused_and_long_ones_cost_others_nothing(served, solo):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4,  # 200 KB (the issue: 2 MB)
            "stop": ["x" * 1000 + str(i) for i in range(200)]}
    error = error_of(together(served, solo, lambda: post(served, "/v1/completions", body)), 400)
    assert error["param"] == "stop" and f"at most {MAX_STOP_STRINGS}" in error["message"]
    too_long = {**body, "stop": ["y" * (MAX_STOP_LENGTH + 1)]}
    assert "characters" in error_of(post(served, "/v1/completions", too_long), 400)["message"]
    # The most a request may give, never matching: it and the others run as alone.
    stops = [f"{i:02d}" + "\u2603" * (MAX_STOP_LENGTH - 2) for i in range(MAX_STOP_STRINGS)]
    text, reason = together(served, solo, lambda: stream_text(served, INNOCENT[0], stop=stops),
                            num_bad_requests=1)
    assert (text, reason) == solo[0]
    assert_clean(served)


# ------------------------------------------------------------ 2 body size


def raw_request(served: Served, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send raw bytes; the status and JSON body of the answer (read to its
    Content-Length, without waiting for the connection to close)."""
    with socket.create_connection((LOOPBACK, served.server.port), timeout=20) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        header, rest = data.split(b"\r\n\r\n", 1)
        lines = header.decode().split("\r\n")
        length = next(int(v) for k, v in (line.split(": ", 1) for line in lines[1:])
                      if k.lower() == "content-length")
        while len(rest) < length:
            rest += sock.recv(65536)
    return int(lines[0].split()[1]), json.loads(rest)


def test_row2_a_body_past_the_limit_gets_413_before_it_is_read(served, solo):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 52428800\r\n\r\n")  # 50 MB announced, none sent

    def refused():
        return raw_request(served, head, b'{"prompt": "')

    status, body = together(served, solo, refused)
    assert status == 413 and "52428800 bytes" in body["error"]["message"]
    big = {"model": "tiny", "prompt": "a " * BODY_LIMIT, "max_tokens": 2}
    assert error_of(post(served, "/v1/completions", big), 413)["type"] == "invalid_request_error"

    def chunked():  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 4096 + 1):
            yield b"a" * 4096
        yield b'"}'

    r = httpx.post(served.url + "/v1/completions", content=chunked(), timeout=60)
    assert "more than" in error_of(r, 413)["message"]
    assert_clean(served)


# ------------------------------------------------------------ 3 decode fault


@pytest.mark.parametrize("stream", [False, True])
def test_row3_a_decode_fault_ends_only_its_request_and_its_client_is_told(served, solo, stream):
    victim = served.tokenizer.encode("Numbers and symbols") + [POISON_DECODE]

    def bad():
        with served.client() as client:
            if not stream:
                with pytest.raises(openai.InternalServerError, match="injected decode fault"):
                    client.completions.create(model="tiny", prompt=victim, max_tokens=8,
                                              temperature=0)
                return
            chunks = client.completions.create(model="tiny", prompt=victim, max_tokens=8,
                                               temperature=0, stream=True)
            with pytest.raises(openai.APIError, match="injected decode fault"):
                list(chunks)

    together(served, solo, bad, num_bad_requests=1)
    assert_clean(served)


# ------------------------------------------------------------ 4 unencodable prompt


def test_row4_a_prompt_the_tokenizer_cannot_encode_is_a_400_and_queues_nothing(served, solo):
    ended = num_ended(served)
    lone = '{"model": "tiny", "prompt": ["Hello", "\\ud800"], "max_tokens": 40}'
    error = error_of(together(served, solo, lambda: post(served, "/v1/completions", lone)), 400)
    assert "not valid Unicode" in error["message"]
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}'
    assert "messages[0].content" in error_of(post(served, "/v1/chat/completions", chat),
                                             400)["message"]
    # a tokenizer that fails on a prompt of a batch: 500 for that body, nothing queued
    fault = {"model": "tiny", "prompt": ["Hello", f"x {ENCODE_FAULT}"], "max_tokens": 40}
    error = error_of(post(served, "/v1/completions", fault), 500)
    assert error["type"] == "server_error" and "injected encode fault" in error["message"]
    assert_clean(served)
    assert num_ended(served) == ended + len(INNOCENT)  # no request of the bad bodies ran


def test_row4_a_batch_refused_after_its_first_prompt_was_queued_aborts_it(model_dir):
    """All or nothing whatever refuses a later prompt: here the waiting
    queue is full when the second comes (429: one sequence runs, one may
    wait); the first, queued behind the running request, is aborted unrun."""
    model, tok = load_tiny(model_dir)
    gated = FaultyModel(model)
    engine = Engine(gated, num_blocks=64, block_size=8, tokenizer=tok, max_num_seqs=1)
    async_engine = AsyncEngine(engine, max_waiting=1)
    with ServerThread(build_app(async_engine, "tiny")) as server, ThreadPoolExecutor(1) as pool:
        body = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True,
                "temperature": 0}  # sampled tokens could draw POISON_FORWARD
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # running
            gated.entered.clear()
            gated.gate.clear()
            assert gated.entered.wait(timeout=30)  # held in its next forward
            refused = pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                                  json={"prompt": ["one", "two"], "max_tokens": 3})
            wait_for(lambda: async_engine.num_pending == 1, "the first prompt was not sent")
            gated.gate.set()  # "one" is admitted behind "Hello"; then "two" finds no place
            assert refused.result().status_code == 429, refused.result().text
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        metrics = async_engine.metrics
        wait_for(lambda: sum(metrics.finished.values()) == 2, "the two requests did not end")
        assert dict(metrics.finished) == {"finished_length": 1, "finished_aborted": 1}
        assert metrics.num_generation_tokens == 60  # the queued prompt never ran
        # "Hello" and "one" were queued; "two" was not
        assert metrics.num_prompt_tokens == len(tok.encode("Hello")) + len(tok.encode("one"))
        assert engine.cache.num_free_blocks + engine.cache.num_cached_blocks == 64
        engine.check_integrity()


# ------------------------------------------------------------ 5 context length


def test_row5_prompts_and_max_tokens_past_the_context_get_vllms_400(served, solo):
    tok = served.tokenizer
    long_prompt = list(range(3, 3 + CONTEXT))
    error = error_of(together(served, solo, lambda: post(served, "/v1/completions", {
        "prompt": long_prompt, "max_tokens": 1})), 400)
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, your request "
        f"has {CONTEXT} input tokens. Please reduce the length of the input messages.")
    prompt = list(range(3, 43))  # 40 tokens
    error = error_of(post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 89}), 400)
    assert error["param"] == "max_tokens" and error["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 89. This model's maximum "
        f"context length is {CONTEXT} tokens and your request has 40 input tokens "
        f"(89 > {CONTEXT} - 40).")
    with served.client() as client:
        fits = client.completions.create(model="tiny", prompt=prompt, max_tokens=88,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert fits.usage.completion_tokens == 88
        # chat's default max_tokens (512) is lowered to what the context leaves
        messages = [{"role": "user", "content": "Hello world"}]
        num_prompt = len(tok.apply_chat_template(messages, add_generation_prompt=True))
        chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == CONTEXT - num_prompt
        assert chat.choices[0].finish_reason == "length"
    assert_clean(served)


def test_row5_max_model_len_is_the_models_context_at_most(model_dir):
    engine, _ = load_engine(model_dir, serve_config(num_blocks=64, block_size=8))
    assert engine.scheduler.config.max_model_len == CONTEXT
    engine, _ = load_engine(model_dir, serve_config(num_blocks=64, block_size=8, max_model_len=100))
    assert engine.scheduler.config.max_model_len == 100
    engine, _ = load_engine(model_dir,
                            serve_config(num_blocks=8, block_size=8))  # the pool holds 64
    assert engine.scheduler.config.max_model_len == 64
    from blockmgr.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="more than the model's context"):
        load_engine(model_dir, serve_config(num_blocks=64, block_size=8, max_model_len=CONTEXT + 1))


@pytest.mark.parametrize("config, context", [
    ({"max_position_embeddings": 4096}, 4096),
    ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048),
    ({"n_positions": 1024}, 1024),
    ({"text_config": {"max_position_embeddings": 8192}}, 8192),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192),
    ({"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 131072),
    ({"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"hidden_size": 64}, None),
])
def test_row5_the_models_context_is_read_as_vllm_reads_it(config, context):
    assert model_context(config) == context


# ------------------------------------------------------------ 6 forward keeps failing


@pytest.mark.parametrize("stream", [False, True])
def test_row6_a_request_whose_forward_keeps_failing_is_told(served, solo, stream):
    victim = served.tokenizer.encode("Numbers and symbols") + [POISON_FORWARD]
    errors = served.engine.stats.num_forward_errors

    def bad():
        with served.client() as client:
            if not stream:
                with pytest.raises(openai.InternalServerError, match="injected forward fault"):
                    client.completions.create(model="tiny", prompt=victim, max_tokens=8)
                return
            chunks = client.completions.create(model="tiny", prompt=victim, max_tokens=8,
                                               stream=True)
            with pytest.raises(openai.APIError, match="injected forward fault"):
                list(chunks)

    together(served, solo, bad, num_bad_requests=1)
    assert served.engine.stats.num_forward_errors > errors
    assert_clean(served)


# ------------------------------------------------------------ 7 cache_salt


def test_row7_cache_salt_is_the_requests_namespace(served, solo):
    prompt = list(range(200, 240))  # ids no other test sends
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = post(served, "/v1/completions", {**body, "cache_salt": "tenant-a"}).json()
    other = together(served, solo, lambda: post(served, "/v1/completions",
                                                {**body, "cache_salt": "tenant-b"}),
                     num_bad_requests=1).json()
    same = post(served, "/v1/completions", {**body, "cache_salt": "tenant-a"}).json()
    unsalted = post(served, "/v1/completions", body).json()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"]
              for r in (first, other, same, unsalted)]
    num_prompt = first["usage"]["prompt_tokens"]
    assert cached[0] == 0 and cached[1] == 0 and cached[3] == 0
    assert cached[2] >= num_prompt - 8  # every full page but the last token's
    assert len({r["choices"][0]["text"] for r in (first, other, same, unsalted)}) == 1
    for salt in ("", 7, ["a"]):
        error = error_of(post(served, "/v1/completions", {**body, "cache_salt": salt}), 400)
        assert error["param"] == "cache_salt"
    assert_clean(served)


# ------------------------------------------------------------ 8 a big prompt


def test_row8_a_big_prompt_is_tokenized_and_refused_off_the_engine_thread(served, solo):
    served.tokenizer.encode_threads.clear()
    text = "Hello world, the quick brown fox. " * 6000  # ~200 KB, ~50k tokens
    error = error_of(together(served, solo, lambda: post(served, "/v1/completions", {
        "prompt": text, "max_tokens": 4})), 400)
    assert "maximum context length is 128 tokens" in error["message"]
    assert served.tokenizer.encode_threads  # it was tokenized...
    assert "blockmgr-engine" not in served.tokenizer.encode_threads  # ...never on the engine's
    assert_clean(served)


# ------------------------------------------------------------ 9 unsupported fields


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "guided_choice", ["a", "b"]),
    ("/v1/chat/completions", "function_call", "required"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "guided_json", {"type": "object"}),
])
def test_row9_fields_that_would_change_the_answer_are_refused(served, solo, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    error = error_of(together(served, solo, lambda: post(served, path, body)), 400)
    assert error["param"] == field and field in error["message"]
    assert_clean(served)


def test_row9_the_values_that_ask_for_nothing_are_accepted(served):
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "temperature": 0}
    r = post(served, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    completion = {"model": "tiny", "max_tokens": 2, "prompt": "Hi", "best_of": 1, "suffix": "",
                  "echo": False, "temperature": 0}
    r = post(served, "/v1/completions", completion)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------ 10 error objects


def test_row10_deep_json_unknown_routes_and_methods_get_error_objects(served, solo):
    deep = "[" * 100_000 + "]" * 100_000
    error = error_of(together(served, solo, lambda: post(served, "/v1/completions", deep)), 400)
    assert "nested too deeply" in error["message"]
    nested = '{"prompt": ' + "[" * 5000 + "1" + "]" * 5000 + "}"
    assert error_of(post(served, "/v1/completions", nested), 400)["type"] == \
        "invalid_request_error"
    assert "Unknown request URL" in error_of(httpx.get(served.url + "/v2/nothing"),
                                             404)["message"]
    r = httpx.get(served.url + "/v1/completions")
    assert "not allowed" in error_of(r, 405)["message"] and "POST" in r.headers["allow"]
    assert_clean(served)
