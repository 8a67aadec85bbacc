"""The operator's surface of the server: /tokenize, /detokenize, /version,
/v1/models/{id}, the opt-in prefix-cache reset, `stop_token_ids` and
`min_tokens` in the body, a draft model, and /metrics (model label,
end-to-end and queue-time histograms, refusals, vLLM's gauge names).

References are independent of the server: the tokenizer loaded on its own,
mlx-lm's `generate_step` (its caches, its logits processors) on a second
copy of the model, the client's own counts and clocks.
"""

from __future__ import annotations

import re
import time

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from scheduler.serving.async_engine import AsyncEngine  # noqa: E402
from scheduler.serving.operator_api import build_serving_app, package_version  # noqa: E402
from scheduler.serving.serve import load_engine, serve_config  # noqa: E402
from tests.scheduler.serving.test_server import ServerThread, httpx, wait_idle  # noqa: E402
from tests.serve_model import build_model_dir, load_tiny  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_tiny(model_dir)


@pytest.fixture(scope="module")
def served(model_dir):
    engine, name = load_engine(model_dir, serve_config(num_blocks=256, block_size=8))
    app = build_serving_app(AsyncEngine(engine, max_waiting=16), name, allow_cache_reset=True)
    with ServerThread(app) as server:
        yield server, engine, name


def reference_tokens(reference, prompt: list[int], max_tokens: int, stop: set[int],
                     min_tokens: int = 0) -> list[int]:
    """mlx-lm's greedy decode with the stop tokens masked (its own logits
    processor) until `min_tokens`, ending at the first stop token (kept)."""
    from mlx_lm.generate import generate_step

    model, _ = reference

    def block_stops(tokens, logits):
        if len(tokens) - len(prompt) < min_tokens:
            mask = mx.zeros(logits.shape[-1])
            mask = mask.at[mx.array(sorted(stop))].add(-mx.inf)
            return logits + mask
        return logits

    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  logits_processors=[block_stops]):
        out.append(int(token))
        if int(token) in stop:
            break
    return out


# ------------------------------------------------------------ endpoints


def test_tokenize_and_detokenize_agree_with_the_tokenizer(served, reference):
    server, _, name = served
    _, tok = reference
    text = "Hello world, hello server!"
    answer = httpx.post(server.url + "/tokenize", json={"model": name, "prompt": text}).json()
    assert answer["tokens"] == list(tok.encode(text))
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == served[1].scheduler.config.max_model_len
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True))
    back = httpx.post(server.url + "/detokenize", json={"tokens": answer["tokens"]}).json()
    assert back == {"prompt": tok.decode(answer["tokens"])}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_bad_tokenize_bodies_get_openai_errors(served, path, body, status, param):
    server, engine, _ = served
    answer = httpx.post(server.url + path, json=body)
    assert answer.status_code == status
    assert answer.json()["error"]["param"] == param
    assert httpx.post(server.url + "/detokenize", json={"tokens": [5]}).status_code == 200


def test_version_and_one_model(served):
    server, _, name = served
    assert httpx.get(server.url + "/version").json() == {"version": package_version()}
    from importlib.metadata import version
    assert package_version() == version("mlx-blockmgr")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        assert client.models.retrieve(name).id == name
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("not-this-one")


def test_prefix_cache_reset_is_opt_in_and_drops_the_cache(served, model_dir):
    server, engine, name = served
    body = {"model": name, "prompt": PROMPT * 6, "max_tokens": 2, "temperature": 0}
    first = httpx.post(server.url + "/v1/completions", json=body).json()
    second = httpx.post(server.url + "/v1/completions", json=body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_idle(engine)
    cached = engine.cache.num_cached_blocks
    reset = httpx.post(server.url + "/reset_prefix_cache")
    assert reset.status_code == 200
    assert reset.json() == {"num_pages_freed": cached}
    assert engine.cache.num_cached_blocks == 0
    third = httpx.post(server.url + "/v1/completions", json=body).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
    # without the flag the route does not exist
    other, other_name = load_engine(model_dir, serve_config(num_blocks=64, block_size=8))
    with ServerThread(build_serving_app(AsyncEngine(other), other_name)) as plain:
        assert httpx.post(plain.url + "/reset_prefix_cache").status_code == 404


# ------------------------------------------------- stop_token_ids, min_tokens


def test_stop_token_ids_and_min_tokens_match_a_greedy_reference(served, reference):
    server, _, name = served
    _, tok = reference
    prompt = list(tok.encode(PROMPT))
    free_run = reference_tokens(reference, prompt, 12, set())
    stop = free_run[2]  # greedy reaches it at the third token
    eos = set(tok.eos_token_ids)
    for min_tokens in (0, 6):
        want = reference_tokens(reference, prompt, 12, {stop} | eos, min_tokens)
        answer = httpx.post(server.url + "/v1/completions", json={
            "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "stop_token_ids": [stop], "min_tokens": min_tokens}).json()
        choice = answer["choices"][0]
        assert answer["usage"]["completion_tokens"] == len(want)
        stopped = want[-1] in {stop} | eos
        assert choice["finish_reason"] == ("stop" if stopped else "length")
        assert choice["text"] == tok.decode(want[:-1] if stopped else want)
        if min_tokens:
            assert len(want) > 3  # the mask changed the answer


def test_min_tokens_above_max_tokens_is_refused(served):
    server, _, name = served
    answer = httpx.post(server.url + "/v1/completions", json={
        "model": name, "prompt": "x", "max_tokens": 3, "min_tokens": 4})
    assert answer.status_code == 400
    assert "min_tokens" in answer.json()["error"]["message"]


def test_a_draft_model_speculates_and_answers_what_greedy_answers(model_dir, reference):
    _, tok = reference
    engine, name = load_engine(model_dir,
                               serve_config(num_blocks=128, block_size=8,
                                            num_speculative_tokens=3), draft_model=model_dir)
    assert engine.speculator is not None
    prompt = list(tok.encode(PROMPT))
    want = reference_tokens(reference, prompt, 10, set())
    with ServerThread(build_serving_app(AsyncEngine(engine), name)) as server:
        answer = httpx.post(server.url + "/v1/completions", json={
            "model": name, "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}).json()
    assert answer["choices"][0]["text"] == tok.decode(want)
    assert engine.stats.num_draft_tokens > 0
    assert engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens  # its own draft


# ---------------------------------------------------------------- metrics


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def test_metrics_label_latencies_refusals_and_vllm_gauges(model_dir):
    engine, name = load_engine(model_dir, serve_config(num_blocks=128, block_size=8))
    label = f'model_name="{name}"'
    with ServerThread(build_serving_app(AsyncEngine(engine), name)) as server:
        url = server.url
        durations = []
        for i in range(3):
            start = time.monotonic()
            ok = httpx.post(url + "/v1/completions", json={
                "prompt": f"{PROMPT} {i}", "max_tokens": 4, "ignore_eos": True})
            durations.append(time.monotonic() - start)
            assert ok.status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": ""}).status_code == 400
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1}
                          ).status_code == 400
        assert httpx.post(url + "/v1/chat/completions", json={
            "model": "other", "messages": [{"role": "user", "content": "x"}]}).status_code == 404
        assert httpx.post(url + "/tokenize", json={}).status_code == 400  # not a completion
        text = httpx.get(url + "/metrics").text
    samples = _samples(text)
    sample_lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert all(label in line for line in sample_lines)
    assert samples[f"blockmgr_kv_pages_total{{{label}}}"] == 128
    e2e_count = samples[f"blockmgr_e2e_request_latency_seconds_count{{{label}}}"]
    assert e2e_count == 3
    e2e_sum = samples[f"blockmgr_e2e_request_latency_seconds_sum{{{label}}}"]
    ttft_sum = samples[f"blockmgr_time_to_first_token_seconds_sum{{{label}}}"]
    assert ttft_sum <= e2e_sum <= sum(durations)
    queue_sum = samples[f"blockmgr_request_queue_time_seconds_sum{{{label}}}"]
    assert samples[f"blockmgr_request_queue_time_seconds_count{{{label}}}"] == 3
    assert 0 <= queue_sum <= ttft_sum
    assert samples[f'blockmgr_requests_refused_total{{{label},status="400"}}'] == 2
    assert samples[f'blockmgr_requests_refused_total{{{label},status="404"}}'] == 1
    assert not any(k.startswith("blockmgr_requests_refused_total") and "429" in k
                   for k in samples)
    assert samples[f"vllm:num_requests_running{{{label}}}"] == 0
    assert samples[f"vllm:num_requests_waiting{{{label}}}"] == 0
    used = (128 - engine.cache.num_free_blocks) / 128
    assert used > 0  # the prefix cache holds the three prompts
    assert samples[f"vllm:kv_cache_usage_perc{{{label}}}"] == pytest.approx(used)
    assert samples[f"vllm:gpu_cache_usage_perc{{{label}}}"] == pytest.approx(used)
    assert re.search(r"^# TYPE vllm:num_requests_running gauge$", text, re.M)


def test_a_model_name_with_quotes_is_escaped_in_the_label(model_dir):
    engine, _ = load_engine(model_dir, serve_config(num_blocks=32, block_size=8))
    async_engine = AsyncEngine(engine)
    build_serving_app(async_engine, 'a"b\\c')
    text = async_engine.metrics.render(engine)
    assert 'blockmgr_kv_pages_total{model_name="a\\"b\\\\c"} 32' in text.splitlines()


# ------------------------------------------------------------ what a gateway asks


def test_gateway_probes_answer_in_sglangs_shapes_and_loads_count_live_pages(served):
    """/server_info, /model_info (and their get_ spellings) describe the pool;
    /v1/loads counts the pages a running request holds (its prompt and
    outputs so far, in pages of 8) and none once it finished, though the
    prefix cache still holds its pages (vLLM's meaning of KV usage)."""
    server, engine, name = served
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(server.url + path).json()
        assert info["served_model_name"] == name and info["version"] == package_version()
        assert info["max_total_tokens"] == 256 * 8 and info["page_size"] == 8
        assert (info["tp_size"], info["dp_size"], info["is_embedding"]) == (1, 1, False)
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(server.url + path).json()["is_generation"] is True
    prompt = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT * 3}).json()["tokens"]
    body = {"model": name, "prompt": prompt, "max_tokens": 300, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        (load,) = httpx.get(server.url + "/v1/loads").json()["loads"]
        for _ in lines:  # to the end
            pass
    assert load["num_running_reqs"] == 1 and load["max_total_num_tokens"] == 256 * 8
    # at least the prompt and a token, at most the prompt and every output, in whole pages
    low, high = -(-(len(prompt) + 1) // 8) * 8, -(-(len(prompt) + 300) // 8) * 8
    assert low <= load["num_used_tokens"] <= high
    assert load["token_usage"] == load["num_used_tokens"] / (256 * 8)
    wait_idle(engine)
    (idle,) = httpx.get(server.url + "/loads").json()["loads"]
    assert idle["num_used_tokens"] == 0 and idle["token_usage"] == 0
    used = re.search(r"^blockmgr_kv_pages_used\S* (\S+)$", httpx.get(server.url + "/metrics").text,
                     re.M)
    assert used is not None and float(used.group(1)) >= low // 8  # the cache kept its pages
