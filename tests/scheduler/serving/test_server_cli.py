"""`blockmgr serve` as a real process: it loads a model directory, sizes the
pool from --kv-memory, answers the openai client on 127.0.0.1, and shuts
down on SIGTERM with a request in flight; bad options are one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
try:  # the HTTP client the openai package uses (httpx before openai 3)
    import httpx2 as httpx  # noqa: E402
except ImportError:
    import httpx  # noqa: E402

from tests.ports import free_port  # noqa: E402
from tests.serve_model import build_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scheduler.cli", "serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def test_serve_answers_and_stops_on_sigterm(tmp_path):
    """SIGTERM with a whole answer and a stream in flight: at the deadline
    (--shutdown-timeout) the engine ends both first, so the whole answer is
    a 503 error object and the stream ends with an error event and [DONE]
    (uvicorn alone cut the stream mid-chunk and gave the other a bare 500)."""
    model = build_model_dir(tmp_path / "tiny", context=4096)
    port = free_port()
    proc = _serve("--model", str(model), "--port", str(port), "--kv-memory", "2MiB",
                  "--block-size", "8", "--shutdown-timeout", "0.5", "--max-model-len", "3000")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4
        client.close()
        # the default body limit: 32 bytes per token of --max-model-len, at least 1 MiB
        big = httpx.post(url + "/v1/completions", timeout=30,
                         json={"prompt": "a" * (2**20 + 1), "max_tokens": 1})
        assert big.status_code == 413 and "at most 1048576 bytes" in big.json()["error"]["message"]
        long = {"prompt": "Hello", "max_tokens": 2900, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, url + "/v1/completions", json=long, timeout=60)
            with httpx.stream("POST", url + "/v1/completions", timeout=30,
                              json={**long, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)  # in flight
                deadline = time.monotonic() + 30
                running = 'blockmgr_requests_running{model_name="tiny"} 2'
                while running not in httpx.get(url + "/metrics").text:
                    assert time.monotonic() < deadline, "the whole answer is not running"
                    time.sleep(0.02)  # both run: the signal comes with both in flight
                proc.send_signal(signal.SIGTERM)
                events = [line for line in lines if line.startswith("data: ")]
            refused = whole.result()
        proc.wait(timeout=30)
        # uvicorn re-raises the signal once it has shut down
        assert proc.returncode in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    err = proc.stderr.read()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error"
    assert all("choices" in json.loads(e[len("data: "):]) for e in events[:-2])  # whole chunks
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    # 2 MiB of pages of 8 tokens: 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes x 8 tokens
    assert "blockmgr serve: tiny: KV pool 0.00 GiB allocated (512 pages of 8 tokens, 4.0 KiB " \
           "each; sized by --kv-memory)" in err
    assert "max model length 3000 tokens" in err
    assert "shutdown deadline reached" in err
    # the engine ended both requests at the deadline: nothing was left to abort at exit
    assert "engine stopped, 0 unfinished requests aborted" in err
    assert "Traceback" not in err and "Cancel" not in err


def test_serve_bad_max_model_len_is_one_line(tmp_path):
    model = build_model_dir(tmp_path / "tiny", context=64)
    proc = _serve("--model", str(model), "--max-model-len", "65")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip() == ("blockmgr serve: error: --max-model-len 65 is more than the "
                           "model's context (64 tokens in its config.json)")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent-dir"], "not an mlx-lm model directory"),
        (["--model", ".", "--kv-memory", "lots"], "not a memory size"),
        (["--model", ".", "--port", "-1"], "--port"),
        (["--model", ".", "--max-model-len", "0"], "--max-model-len"),
        (["--model", ".", "--max-body-size", "huge"], "not a memory size"),
        (["--model", ".", "--kv-bits", "3"], "argument --kv-bits: invalid choice: 3"),
        (["--model", ".", "--kv-bits", "8", "--kv-group-size", "16"],
         "argument --kv-group-size: invalid choice: 16"),
        (["--model", ".", "--kv-group-size", "32"], "--kv-group-size needs --kv-bits"),
        (["--model", ".", "--kv-bits", "4", "--kv-key-bits", "8", "--kv-value-bits", "8"],
         "--kv-bits has no effect"),
        (["--model", ".", "--kv-memory-fraction", "1.5"], "--kv-memory-fraction"),
    ],
)
def test_serve_bad_options_are_one_line(args, message):
    proc = _serve(*args)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockmgr serve: error:"), err
    assert message in lines[0]


def test_serve_quantized_pages_sizes_the_pool_by_their_bytes(tmp_path):
    """--kv-memory divided by the quantized page: 2 layers x 2 kv heads x 8
    tokens x (8-bit key row of 32: 32 bytes + a float32 scale and bias;
    4-bit value row: 16 + 8) = 2 KiB a page, 512 pages in 1 MiB (at the
    model's float32 it would be 8 KiB, 128 pages). The format is in the
    start-up line and /metrics, and the server answers from those pages."""
    model = build_model_dir(tmp_path / "tiny", context=512, head_dim=32)
    port = free_port()
    proc = _serve("--model", str(model), "--port", str(port), "--kv-memory", "1MiB",
                  "--block-size", "8", "--kv-key-bits", "8", "--kv-value-bits", "4",
                  "--kv-group-size", "32")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(proc, url)
        answer = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}).json()
        assert answer["usage"]["completion_tokens"] == 4
        metrics = httpx.get(url + "/metrics").text.splitlines()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    err = proc.stderr.read()
    assert ('blockmgr_cache_config_info{model_name="tiny",kv_format="k8v4-g32",block_size="8",'
            'num_pages="512"} 1' in metrics)
    assert 'blockmgr_kv_pages_total{model_name="tiny"} 512' in metrics
    assert ("blockmgr serve: tiny: 512 pages of 8 tokens, k8v4-g32 (2.00 KiB each): "
            "1.00 MiB of KV" in err), err
    assert ("blockmgr serve: the same pool in the simulator: blockmgr simulate --kv-memory 1MiB "
            "--kv-shape layers=2,kv_heads=2,head_dim=32,dtype=float32 --block-size 8 "
            "--kv-key-bits 8 --kv-value-bits 4 --kv-group-size 32 --max-num-seqs 64 "
            "--max-context 512" in err), err


def test_serve_refuses_a_group_size_the_head_size_does_not_divide(tmp_path):
    model = build_model_dir(tmp_path / "tiny", context=64)  # head size 16
    proc = _serve("--model", str(model), "--kv-bits", "8", "--kv-group-size", "32")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockmgr serve: error: layer 0: key head "
                                                   "size 16 is not a multiple of the kv group "
                                                   "size 32"), err
def _rss(pid: int) -> int:
    """The process's resident bytes now (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc (Linux)")
def test_serve_allocates_the_pool_at_start_and_logs_its_status(tmp_path):
    """The pool is resident before the first request and the start-up line
    gives its real size; while busy a status line comes every interval."""
    model = build_model_dir(tmp_path / "tiny", context=4096)
    port = free_port()
    proc = _serve("--model", str(model), "--port", str(port), "--kv-memory", "256MiB",
                  "--status-interval", "0.3")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(proc, url)
        # pages of 16 tokens: 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes x 16 tokens = 8 KiB
        assert _rss(proc.pid) > 256 * 2**20  # before any request
        body = {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body,
                                                         timeout=120), range(2)))
        assert all(a.status_code == 200 for a in answers)
        time.sleep(0.6)  # one more interval: the line of the last tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    err = proc.stderr.read()
    assert ("blockmgr serve: tiny: KV pool 0.25 GiB allocated (32768 pages of 16 tokens, 8.0 KiB "
            "each; sized by --kv-memory)") in err
    status = [line for line in err.splitlines() if "blockmgr serve: running" in line]
    assert status, err
    rates = [float(line.rsplit("generation ", 1)[1].split()[0]) for line in status]
    assert any(rate > 0 for rate in rates)
    assert all(" of 32768 pages" in line for line in status)


def test_serve_sizes_the_pool_from_the_available_memory(tmp_path):
    """Without --kv-memory: --kv-memory-fraction of MemAvailable (read here
    on its own) less the weights; a shared machine moves it a little."""
    from scheduler.serving.serve import kv_budget

    model = build_model_dir(tmp_path / "tiny")
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("reads /proc/meminfo (Linux)")
    free = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                if line.startswith("MemAvailable:"))
    weights = (model / "model.safetensors").stat().st_size
    budget = kv_budget(None, [model], 0.25)
    assert budget.fraction == 0.25
    assert budget.nbytes == pytest.approx(0.25 * (free - weights), rel=0.05)
    assert "0.25 of" in budget.describe() and "GiB available after the weights" in \
        budget.describe()
    assert kv_budget("3MiB", [model]).nbytes == 3 * 2**20
