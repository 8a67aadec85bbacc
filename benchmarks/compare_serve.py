"""`blockmgr serve` beside `mlx_lm.server`, same model directory, same load.

Builds a Qwen3-0.6B-shaped model (hidden 1024, 16 heads / 8 KV heads of
128, vocabulary 151936; `--layers` layers, random float32 weights) with a
byte-level BPE tokenizer trained locally, writes it in mlx-lm's format,
then for each server: starts it on 127.0.0.1 (a subprocess, the same
environment, so the same BLAS), sends the workload from `--concurrency`
client threads with the official openai client (streaming chat, greedy),
and reports output tokens/s, TTFT p50/p99 and the server's peak RSS
(VmHWM). Workloads: `shared` (one system prompt of ~`--system-tokens`
tokens, a short unique question each) and `multiturn` (conversations whose
every turn resends the whole history).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/compare_serve.py --requests 32 --concurrency 8
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.serve_model import build_tokenizer  # noqa: E402


def build_qwen3_dir(path: Path, layers: int) -> Path:
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model

    build_tokenizer(path)
    config = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": layers,
              "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 151936,
              "max_position_embeddings": 40960, "rope_theta": 1e6, "tie_word_embeddings": True}
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def start(kind: str, model_dir: Path, port: int, concurrency: int,
          kv_memory: str) -> subprocess.Popen:
    if kind == "blockmgr":
        cmd = [sys.executable, "-m", "scheduler.cli", "serve", "--model", str(model_dir),
               "--port", str(port), "--kv-memory", kv_memory, "--max-num-seqs", "64"]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
               "--port", str(port), "--decode-concurrency", str(concurrency),
               "--prompt-concurrency", str(concurrency), "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    try:  # the HTTP client the openai package uses (httpx before openai 3)
        import httpx2 as httpx
    except ImportError:
        import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not come up")


def workload(kind: str, num_requests: int, system_tokens: int, seed: int = 0) -> list[list]:
    rng = np.random.default_rng(seed)
    words = ("paged attention keeps the cache in fixed size blocks while a prefix trie "
             "shares the system prompt between requests streams of tokens").split()

    def sentence(n):
        return " ".join(rng.choice(words, size=n))

    if kind == "shared":
        system = sentence(system_tokens // 2)
        return [[{"role": "system", "content": system},
                 {"role": "user", "content": sentence(12)}] for _ in range(num_requests)]
    chats, turns = [], 4  # multiturn: each conversation resends its history
    for _ in range(num_requests // turns):
        history = [{"role": "system", "content": sentence(system_tokens // 8)}]
        for _ in range(turns):
            history = history + [{"role": "user", "content": sentence(20)}]
            chats.append(list(history))
            history = history + [{"role": "assistant", "content": sentence(24)}]
    return chats


def run_load(url: str, model: str, chats: list[list], max_tokens: int, concurrency: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
    ttfts, tokens, lock, queue = [], [0], threading.Lock(), list(range(len(chats)))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            t0 = time.perf_counter()
            first = None
            count = 0
            stream = client.chat.completions.create(
                model=model, messages=chats[i], max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None and first is None:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    count = chunk.usage.completion_tokens
            with lock:
                ttfts.append(first if first is not None else time.perf_counter() - t0)
                tokens[0] += count

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    client.close()
    return {"wall": wall, "tokens": tokens[0], "tok_s": tokens[0] / wall,
            "ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--servers", default="blockmgr,mlx_lm")
    parser.add_argument("--kv-memory", default="256MiB", help="blockmgr serve's page pool")
    parser.add_argument("--workloads", default="shared,multiturn")
    args = parser.parse_args()
    blas = "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "") else \
        "bundled reference BLAS"
    print(f"# {platform.machine()} {os.cpu_count()} cores, mlx {mx.__version__}, {blas}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_qwen3_dir(Path(tmp) / "qwen3-shape", args.layers)
        print(f"| workload | server | output tok/s | TTFT p50 (s) | TTFT p99 (s) | peak RSS (MiB) |")
        print("|---|---|---|---|---|---|")
        for name in args.workloads.split(","):
            chats = workload(name, args.requests, args.system_tokens)
            for kind in args.servers.split(","):
                port = free_port()
                proc = start(kind, model_dir, port, args.concurrency, args.kv_memory)
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_up(url, proc)
                    model = model_dir.name if kind == "blockmgr" else str(model_dir)
                    run_load(url, model, chats[:2], args.max_tokens, 1)  # warm-up
                    r = run_load(url, model, chats, args.max_tokens, args.concurrency)
                    rss = peak_rss(proc.pid)
                finally:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                print(f"| {name} | {kind} | {r['tok_s']:.1f} | {r['ttft_p50']:.3f} | "
                      f"{r['ttft_p99']:.3f} | {rss / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
