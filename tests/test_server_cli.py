"""`blockmgr serve` as a real process: it loads a model directory, sizes the
pool from --kv-memory, answers the openai client on 127.0.0.1, and shuts
down on SIGTERM with a request in flight; bad options are one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
try:  # the HTTP client the openai package uses (httpx before openai 3)
    import httpx2 as httpx  # noqa: E402
except ImportError:
    import httpx  # noqa: E402

from tests.serve_model import build_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scheduler.cli", "serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_serve_answers_and_stops_on_sigterm(tmp_path):
    model = build_model_dir(tmp_path / "tiny")
    port = _free_port()
    proc = _serve("--model", str(model), "--port", str(port), "--kv-memory", "2MiB",
                  "--block-size", "8", "--shutdown-timeout", "0.5")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4
        client.close()
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # in flight
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        # uvicorn re-raises the signal once it has shut down
        assert proc.returncode in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    err = proc.stderr.read()
    # 2 MiB of pages of 8 tokens: 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes x 8 tokens
    assert "blockmgr serve: tiny: 512 pages of 8 tokens" in err
    # the in-flight stream was cut by uvicorn's shutdown timeout, which aborts
    # its request; the engine then stops with nothing left
    assert "engine stopped, 0 unfinished requests aborted" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent-dir"], "not an mlx-lm model directory"),
        (["--model", ".", "--kv-memory", "lots"], "not a memory size"),
        (["--model", ".", "--port", "-1"], "--port"),
    ],
)
def test_serve_bad_options_are_one_line(args, message):
    proc = _serve(*args)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockmgr serve: error:"), err
    assert message in lines[0]
