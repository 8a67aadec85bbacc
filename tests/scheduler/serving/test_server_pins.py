"""The server's prefix-cache pins: POST /v1/cache/pins pins the cached
prefix of a prompt (it stays out of every eviction), GET lists the pins,
DELETE releases one; bad bodies, a pin id in use and an unknown pin are
OpenAI error objects (400, 404)."""

from __future__ import annotations

import pytest

from tests.scheduler.serving.test_server import httpx


def test_pin_list_and_unpin_a_prompts_cached_prefix(served, reference):
    server, engine, name = served
    _, tok = reference
    prompt = tok.encode("A system prompt and a tool list that every agent turn sends. " * 3)
    url = server.url + "/v1/cache/pins"
    answer = httpx.post(server.url + "/v1/completions", json={
        "model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=60)
    assert answer.status_code == 200
    pinned = httpx.post(url, json={"pin_id": "system", "prompt": prompt}, timeout=60)
    assert pinned.status_code == 200
    cached = pinned.json()["cached_tokens"]
    assert cached == engine.cache.cached_prefix_length(prompt + [0]) > 16
    assert httpx.get(url).json() == {"data": [{"pin_id": "system", "cached_tokens": cached}]}
    again = httpx.post(url, json={"pin_id": "system", "prompt": prompt})
    assert again.status_code == 400 and "already held" in again.json()["error"]["message"]
    for bad in ({"prompt": prompt}, {"pin_id": "", "prompt": prompt}, {"pin_id": "x"},
                {"pin_id": "x", "prompt": [-1]}):
        response = httpx.post(url, json=bad)
        assert response.status_code == 400 and response.json()["error"]["message"]
    assert engine.cache.pinned() == {"system": cached}
    assert httpx.delete(url + "/system").json() == {"pin_id": "system", "deleted": True}
    assert engine.cache.pinned() == {}
    missing = httpx.delete(url + "/system")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("prompt", ["never seen text", [5, 6, 7]])
def test_pinning_what_is_not_cached_pins_nothing(served, prompt):
    server, engine, _ = served
    response = httpx.post(server.url + "/v1/cache/pins", json={"pin_id": "n", "prompt": prompt})
    assert response.json() == {"pin_id": "n", "cached_tokens": 0}
    assert "n" not in engine.cache.pinned()
