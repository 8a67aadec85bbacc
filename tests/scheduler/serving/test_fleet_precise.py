"""Precise routing end to end: three `blockmgr serve --grpc-port` replicas
behind `smg launch --policy cache_aware`, routed on their own KV events.

The replicas are SMG's gRPC workers (`scheduler/serving/grpc_worker.py`):
the gateway tokenizes, sends token ids, and subscribes to each replica's
`SubscribeKvEvents` stream, whose blocks feed its event index. Each
session's opening prefix is first sent to one replica directly, not
through the gateway, so nothing but that replica's events tells the
gateway where it is. Then the sessions go through the gateway in
parallel, turns in order. Every turn must be served by the replica whose
events advertise its prefix: the first by the replica that was warmed, the
later ones by the same replica (their prefix grew there). Checked three
ways: each turn's reported hit covers the full pages of what that replica
holds of its prompt and is longer than anything another replica holds of
it; each replica finished exactly its sessions' requests; and the
gateway's own count of its decisions says every routed request took the
event index's hit branch (`smg_cache_aware_policy_branch_total{branch=
"event_hit"}`), with no miss and no text or token tree match, over an event
stream without gaps. Every answer is mlx-lm's greedy decode of its prompt
on a second copy of the model.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("grpc", reason="the gRPC worker needs grpcio (pip install '.[fleet]')")
pytest.importorskip("smg_grpc_proto", reason="needs smg-grpc-proto (pip install '.[fleet]')")

from tests.fleet import Fleet, httpx, smg_binary  # noqa: E402
from tests.reference import greedy_reference  # noqa: E402
from tests.scheduler.serving.test_fleet_gateway import (  # noqa: E402 - the same sessions
    BLOCK_SIZE,
    MAX_TOKENS,
    NUM_REPLICAS,
    NUM_SESSIONS,
    NUM_TURNS,
    _lcp,
    _session_prefix,
    _user_turn,
)
from tests.serve_model import build_model_dir, load_tiny  # noqa: E402

if smg_binary() is None:
    pytest.skip("the precise-routing test needs the smg binary: pip install 'mlx-blockmgr[fleet]'",
                allow_module_level=True)


def _generate(client, url: str, prompt: str, max_tokens: int) -> dict:
    """SGLang's /generate through the gateway (text in; the text, the token
    ids and the usage out): the ids are what is compared, as the gateway's
    detokenizer holds back the incomplete UTF-8 tail a random model emits."""
    answer = client.post(url + "/generate", json={
        "model": "tiny", "text": prompt, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body[0] if isinstance(body, list) else body


def _run_session(url: str, session: int) -> list[dict]:
    """The session's turns in order through the gateway."""
    turns, history = [], _session_prefix(session)
    with httpx.Client(timeout=120) as client:
        for turn in range(NUM_TURNS):
            prompt = history + _user_turn(session, turn)
            body = _generate(client, url, prompt, MAX_TOKENS)
            meta = body["meta_info"]
            turns.append({"session": session, "turn": turn, "prompt": prompt,
                          "output": body["output_ids"], "cached": meta["cached_tokens"],
                          "num_prompt": meta["prompt_tokens"]})
            history = prompt + body["text"]
    return turns


def _samples(metrics: str, name: str, **labels: str) -> float:
    """The sum of a family's samples whose labels include `labels`."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("#") or not re.match(rf"{name}[{{ ]", line):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_indexed(fleet: Fleet, blocks: dict[str, int], timeout: float = 30.0) -> None:
    """Until the gateway's event index holds at least `blocks[worker url]`
    blocks of each replica (what its KV events advertised)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(fleet.metrics_url, timeout=5).text
        have = {w: _samples(metrics, "smg_kv_index_blocks", worker=w) for w in blocks}
        if all(have[w] >= n for w, n in blocks.items()):
            return
        assert time.monotonic() < deadline, f"the event index holds {have}, not {blocks}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("precise") / "tiny", context=4096)


def test_smg_routes_sessions_on_the_replicas_kv_events(model_dir, tmp_path):
    model, tok = load_tiny(model_dir)
    serve_args = ("--kv-memory", "2MiB", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
                  "--status-interval", "0")
    home = {s: s % NUM_REPLICAS for s in range(NUM_SESSIONS)}  # the replica warmed per session
    with Fleet(model_dir, NUM_REPLICAS, "cache_aware", tmp_path / "logs", serve_args=serve_args,
               grpc=True) as fleet:
        # each session's prefix on its home replica, behind the gateway's back
        warmed = {r: 0 for r in range(NUM_REPLICAS)}
        with httpx.Client(timeout=120) as client:
            for s, r in home.items():
                warm = client.post(fleet.replica_urls[r] + "/v1/completions", json={
                    "model": "tiny", "prompt": _session_prefix(s), "max_tokens": 1})
                assert warm.status_code == 200, warm.text
                warmed[r] += len(tok.encode(_session_prefix(s))) // BLOCK_SIZE
        _wait_indexed(fleet, {fleet.worker_urls[r]: n for r, n in warmed.items()})
        with ThreadPoolExecutor(NUM_SESSIONS) as pool:
            sessions = list(pool.map(lambda s: _run_session(fleet.url, s), range(NUM_SESSIONS)))
        gateway = httpx.get(fleet.metrics_url, timeout=5).text
        replica_metrics = [httpx.get(u + "/metrics", timeout=5).text for u in fleet.replica_urls]
        workers = httpx.get(fleet.url + "/workers", timeout=5).json()["workers"]

    # the gateway took the replicas for vLLM gRPC workers
    assert sorted(w["url"] for w in workers) == sorted(fleet.worker_urls)
    assert all(w["connection_mode"] == "grpc" and w["runtime_type"] == "vllm" for w in workers)

    # every answer is mlx-lm's greedy decode of its prompt, tokenized by the gateway as here;
    # computed[s]: the tokens whose KV a request of session s left on its replica
    computed = {s: [tok.encode(_session_prefix(s))] for s in home}
    for turns in sessions:
        for t in turns:
            prompt = tok.encode(t["prompt"])
            assert t["num_prompt"] == len(prompt)
            want = greedy_reference(model, prompt, MAX_TOKENS)
            assert t["output"] == want, (t["session"], t["turn"])
            t["tokens"] = prompt
            computed[t["session"]].append(prompt + want[:-1])  # the last token is not computed

    # each turn was served by its session's home replica: its hit covers the full pages of
    # what the session left there before it, and no other replica holds as much of it
    for turns in sessions:
        for t in turns:
            s = t["session"]
            mine = max(_lcp(t["tokens"], h) for h in computed[s][:t["turn"] + 1])
            others = max(_lcp(t["tokens"], h) for q in home if home[q] != home[s]
                         for h in computed[q])
            assert t["cached"] >= mine // BLOCK_SIZE * BLOCK_SIZE > others, (
                s, t["turn"], t["cached"], mine, others)
    finished = [_samples(m, "blockmgr_requests_finished_total") for m in replica_metrics]
    per_replica = [sum(1 for r in home.values() if r == q) * (1 + NUM_TURNS)
                   for q in range(NUM_REPLICAS)]
    assert finished == per_replica

    # the gateway's decisions: every routed request by the event index, a hit
    routed = NUM_SESSIONS * NUM_TURNS
    branch = "smg_cache_aware_policy_branch_total"
    assert _samples(gateway, branch, branch="event_hit") == routed, gateway
    for other in ("event_miss", "tree_match", "event_spill"):
        assert _samples(gateway, branch, branch=other) == 0, other
    for w in fleet.worker_urls:  # a whole stream per replica: no gap, no parentless block
        assert _samples(gateway, "smg_kv_event_batches_total", worker=w, disposition="applied") > 0
        assert _samples(gateway, "smg_kv_event_missed_batches_total", worker=w) == 0
        assert _samples(gateway, "smg_kv_event_parentless_blocks_total", worker=w) == 0
