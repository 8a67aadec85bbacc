"""What one hostile request costs the others: this checkout's `blockmgr serve`
beside another checkout's (`--base`), same model directory, same load.

Each server runs as a process on the tiny model of the server tests
(`tests/serve_model.py`: a 2-layer random llama), `--kv-memory 64MiB`,
pages of 16 tokens. Scenarios (issue 25's rows with figures):

* `stop`: 4 greedy streams of `--max-tokens` tokens, alone, then beside one
  more stream whose request carries stop strings that never match (2,000 of
  1,000 characters, then 16 of 256: this server's limit). Figures: the
  innocents' wall time and its ratio to alone; what the stop request got.
* `body`: one 50 MB JSON body (a text prompt) while a stream runs: time to
  the answer and its status, the server's RSS before, at its peak during
  the request (VmHWM, reset first) and after, and the longest gap between
  two chunks of the running stream.
* `prompt`: one 5 MB text prompt (past the context: refused), then one of
  3.5 MB (under this server's default body limit for this context, 4 MiB:
  tokenized, then refused) while a stream runs: time to the answer, the
  stream's longest gap between chunks, the server's RSS.

    python benchmarks/serve_faults.py --base /tmp/base-checkout [--only stop,body,prompt]

A gap is measured on a stream that decodes one token per step: its median
gap is the step time, and its longest gap during the bad request is how
long that request held every other client.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

try:  # the HTTP client the openai package uses (httpx before openai 3)
    import httpx2 as httpx
except ImportError:
    import httpx

from benchmarks.compare_serve import free_port, wait_up  # noqa: E402
from tests.serve_model import build_model_dir  # noqa: E402

INNOCENT = ["Hello world", "The quick brown fox", "A prefix trie", "Streams of tokens"]


def start(root: Path, model_dir: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scheduler.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--kv-memory", "64MiB", "--block-size", "16"]
    return subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(root)})


def rss(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status
            if line.startswith(("VmRSS:", "VmHWM:"))}


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def stream(url: str, prompt: str, max_tokens: int, stop=None, times: list | None = None,
           done: threading.Event | None = None) -> dict:
    """One greedy completion stream; chunk arrival times go to `times`;
    left (the request aborted) once `done` is set. The body is encoded
    before the clock of the caller starts (a 2 MB body takes a while)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    if stop is not None:
        body["stop"] = stop
    content = json.dumps(body).encode()
    text, error = "", None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", content=content, timeout=3600,
                      headers={"content-type": "application/json"}) as r:
        status, answered = r.status_code, time.perf_counter() - t0
        if status != 200:
            return {"status": status, "answer_s": answered,
                    "error": json.loads(r.read())["error"]["message"][:80]}
        for line in r.iter_lines():
            if done is not None and done.is_set():
                break
            if line.startswith("data: ") and times is not None:
                times.append(time.perf_counter())
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                else:
                    text += chunk["choices"][0]["text"]
    return {"status": status, "text": text, "error": error, "answer_s": answered}


def innocents(url: str, max_tokens: int) -> tuple[float, list[str]]:
    start_time = time.perf_counter()
    with ThreadPoolExecutor(len(INNOCENT)) as pool:
        outs = list(pool.map(lambda p: stream(url, p, max_tokens)["text"], INNOCENT))
    return time.perf_counter() - start_time, outs


def scenario_stop(url: str, max_tokens: int, repeat: int) -> dict:
    """The innocents' wall time alone and beside a stop request, `repeat`
    rounds interleaved; medians and the ratio of medians."""
    conditions = {"alone": None, "2000x1000": (2000, 1000), "16x256": (16, 256)}
    times: dict[str, list[float]] = {name: [] for name in conditions}
    answers: dict[str, str] = {}
    want = None
    for _ in range(repeat):
        for name, shape in conditions.items():
            if shape is None:
                took, outs = innocents(url, max_tokens)
            else:
                count, length = shape
                stops = [f"{i:04d}" + "\u2603" * (length - 4) for i in range(count)]
                with ThreadPoolExecutor(1) as pool:
                    bad = pool.submit(stream, url, "Numbers and symbols", max_tokens, stops)
                    took, outs = innocents(url, max_tokens)
                    answer = bad.result()
                answers[name] = (answer.get("error") or str(answer["status"])) + \
                    f" (answered in {answer['answer_s']:.3f} s)"
            want = want or outs
            assert outs == want, "an innocent stream changed"
            times[name].append(took)
    alone = statistics.median(times["alone"])
    result = {"innocents_alone_s": round(alone, 2), "runs_s": times}
    for name in ("2000x1000", "16x256"):
        took = statistics.median(times[name])
        result[name] = {"innocents_s": round(took, 2), "ratio_to_alone": round(took / alone, 2),
                        "stop_request": answers[name]}
    return result


def with_running_stream(url: str, pid: int, send) -> dict:
    """Run `send()` while a long stream decodes; its time and answer, the
    stream's gaps, the server's RSS before, at peak and after."""
    times: list[float] = []
    done = threading.Event()
    runner = threading.Thread(target=stream, args=(url, INNOCENT[0], 100_000, None, times, done))
    runner.start()
    while len(times) < 50:
        time.sleep(0.05)
    reset_peak(pid)
    before = rss(pid)["VmRSS"]
    t0 = time.perf_counter()
    status, message = send()
    t1 = time.perf_counter()
    memory = rss(pid)
    time.sleep(1.0)
    done.set()
    runner.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
    assert times[-1] > t1, "the stream ended before the bad request was answered"
    return {"status": status, "message": message[:90], "answer_s": round(t1 - t0, 3),
            "stream_median_gap_s": round(statistics.median(gaps), 4),
            "stream_longest_gap_s": round(max(during, default=0.0), 3),
            "rss_before_mib": before >> 20, "rss_peak_mib": memory["VmHWM"] >> 20,
            "rss_after_mib": memory["VmRSS"] >> 20}


def raw_post(url: str, body: bytes) -> tuple[int, str]:
    """POST `body` on a raw socket, sending while no answer came (a server may
    answer before reading it); the status and the error message."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        sock.setblocking(False)
        sent, data = 0, b""
        while b"\r\n\r\n" not in data:
            try:
                data += sock.recv(65536)
                continue
            except BlockingIOError:
                pass
            if sent < len(body):
                try:
                    sent += sock.send(body[sent:sent + 2**20])
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    time.sleep(0.001)
            else:
                time.sleep(0.01)
        sock.setblocking(True)
        head, rest = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(65536)
    status = int(head.split()[1])
    try:
        message = json.loads(rest)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = rest.decode(errors="replace")
    return status, message


def text_body(num_bytes: int) -> bytes:
    words = "Hello world, the quick brown fox jumps. "
    return json.dumps({"prompt": (words * (num_bytes // len(words) + 1))[:num_bytes],
                       "max_tokens": 4}).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--only", default="stop,body,prompt")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the stop scenario")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens of each stream of the stop scenario")
    args = parser.parse_args()
    scenarios = args.only.split(",")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "tiny")
        for name, root in (("base", args.base), ("this", ROOT)):
            port = free_port()
            proc = start(root, model_dir, port)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_up(url, proc)
                out = results[name] = {}
                if "stop" in scenarios:
                    out["stop"] = scenario_stop(url, args.max_tokens, args.repeat)
                if "body" in scenarios:
                    body = text_body(50 * 2**20)
                    out["body_50MB"] = with_running_stream(url, proc.pid,
                                                           lambda: raw_post(url, body))
                if "prompt" in scenarios:  # the 5 MB; 3.5 MB passes the new limit
                    for mb in (5, 3.5):
                        body = text_body(int(mb * 2**20))
                        out[f"prompt_{mb}MB"] = with_running_stream(
                            url, proc.pid, lambda: raw_post(url, body))
                print(name, json.dumps(out, indent=1), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
