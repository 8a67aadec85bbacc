"""Three `blockmgr serve` replicas behind the Shepherd Model Gateway (SMG,
the `fleet` extra) with its `cache_aware` policy, as real processes.

A multi-session workload (sessions with their own long prefix, each turn
quoting the conversation so far) goes through the gateway, sessions in
parallel, turns in order. Every answer must be mlx-lm's own greedy decode
of its prompt on a second copy of the model (the reference the one-server
tests use), and every turn after the first must have been served by the
replica that served the turn before it: its reported prefix hit is longer
than anything another replica could hold (the longest common prefix of its
prompt with the prompt + answer of every other request sent before). The
replicas answer every probe the gateway sends (no 404 in their access
logs), the gateway reads their KV capacity from their load reports, and an
idle replica reports no KV load though its prefix cache is full of pages.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvicorn")

from tests.fleet import Fleet, httpx, smg_binary  # noqa: E402
from tests.reference import greedy_reference  # noqa: E402
from tests.serve_model import SENTENCES, build_model_dir, load_tiny  # noqa: E402

if smg_binary() is None:
    pytest.skip("the gateway test needs the smg binary: pip install 'mlx-blockmgr[fleet]'",
                allow_module_level=True)

NUM_REPLICAS = 3
NUM_SESSIONS = 6
NUM_TURNS = 3
MAX_TOKENS = 8
BLOCK_SIZE = 8
NUM_PAGES = 512  # --kv-memory 2MiB: the tiny llama's pages are 4 KiB


def _session_prefix(session: int) -> str:
    body = " ".join(SENTENCES[(session + j) % len(SENTENCES)] for j in range(4))
    return f"Session {session} of the fleet. {body}"


def _user_turn(session: int, turn: int) -> str:
    first, second = SENTENCES[(session + turn) % 6], SENTENCES[(session + 2 * turn + 1) % 6]
    return f"\nUser {session}.{turn}: {first} {second}\nAnswer:"


def _run_session(url: str, session: int) -> list[dict]:
    """The session's turns in order through the gateway: [{prompt, text, cached}]."""
    turns, history = [], _session_prefix(session)
    with httpx.Client(timeout=120) as client:
        for turn in range(NUM_TURNS):
            prompt = history + _user_turn(session, turn)
            answer = client.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            text = body["choices"][0]["text"]
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            turns.append({"session": session, "turn": turn, "prompt": prompt, "text": text,
                          "cached": cached})
            history = prompt + text
    return turns


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _samples(metrics: str, name: str) -> float:
    """The sum of a family's samples in a Prometheus text (labels ignored)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _gateway_loads(url: str, timeout: float = 30.0) -> dict[str, int]:
    """{replica url: KV tokens} from the gateway's /get_loads, once it has
    polled every replica (its load monitor polls every 10 s)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = httpx.get(url + "/get_loads", timeout=5).json()["loads"]
        tokens = {w["worker"]: w["max_total_num_tokens"] for w in loads}
        if len(tokens) == NUM_REPLICAS and all(tokens.values()) or time.monotonic() > deadline:
            return tokens
        time.sleep(0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("fleet") / "tiny", context=4096)


def test_sessions_stick_to_one_replica_behind_smg_cache_aware(model_dir, tmp_path):
    serve_args = ("--kv-memory", "2MiB", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
                  "--status-interval", "0")
    with Fleet(model_dir, NUM_REPLICAS, "cache_aware", tmp_path / "logs",
               serve_args=serve_args) as fleet:
        with ThreadPoolExecutor(NUM_SESSIONS) as pool:
            sessions = list(pool.map(lambda s: _run_session(fleet.url, s), range(NUM_SESSIONS)))
        loads = _gateway_loads(fleet.url)
        replica_metrics = [httpx.get(u + "/metrics", timeout=5).text for u in fleet.replica_urls]
        idle_loads = [httpx.get(u + "/v1/loads", timeout=5).json()["loads"][0]
                      for u in fleet.replica_urls]
        logs = [fleet.replica_log(i) for i in range(NUM_REPLICAS)]

    # the gateway read each replica's load report: its KV tokens are the pool's
    assert sorted(loads) == sorted(fleet.replica_urls)
    assert all(tokens == NUM_PAGES * BLOCK_SIZE for tokens in loads.values()), loads
    # every probe the gateway sent was answered (before: /server_info, /loads, ... 404)
    for log in logs:
        assert re.findall(r'"GET [^"]*" 404', log) == []

    # idle, a replica's load is 0 though its prefix cache holds pages: only the pages of
    # live sequences count (vLLM's meaning), or the gateway's overload protection (0.8 by
    # default) would turn sessions away from the warm replica that holds their prefix
    for load, metrics in zip(idle_loads, replica_metrics):
        assert load["token_usage"] == 0 and load["num_used_tokens"] == 0
        assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
        served = _samples(metrics, "blockmgr_requests_finished_total") > 0
        assert (_samples(metrics, "blockmgr_kv_pages_used") > 0) == served
    # every request was served, and more than one replica served them
    finished = [_samples(m, "blockmgr_requests_finished_total") for m in replica_metrics]
    assert sum(finished) == NUM_SESSIONS * NUM_TURNS
    assert sum(1 for f in finished if f > 0) >= 2, finished

    model, tok = load_tiny(model_dir)
    held = []  # (session, turn, tokens a replica holds after the request)
    for turns in sessions:
        for t in turns:
            prompt = tok.encode(t["prompt"])
            want = greedy_reference(model, prompt, MAX_TOKENS)
            assert t["text"] == tok.decode(want), (t["session"], t["turn"])
            t["tokens"] = prompt
            held.append((t["session"], t["turn"], prompt + want))
    for turns in sessions:
        for t in turns[1:]:
            # what another replica can hold: other sessions, this one's turns before the last
            others = [_lcp(t["tokens"], h) for s, k, h in held
                      if s != t["session"] or k < t["turn"] - 1]
            # only the replica that served the turn before holds a prefix this long
            assert t["cached"] > max(others), (t["session"], t["turn"], t["cached"], max(others))
