"""`benchmarks/compare_tiers.py`'s agent workload against `mlx_lm.server`.

The same model shape (`compare_tiers.model`, random float32 weights, saved in
mlx-lm's format with a word-level tokenizer of its vocabulary, one word per
token id), the same prompts in the same round-robin order, one request at a
time (`/v1/completions`, `max_tokens` 1, greedy). `mlx_lm.server`'s prompt
cache is given the byte budget of compare_tiers's device pool
(`--prompt-cache-bytes`, and `--prompt-cache-size` high enough not to bind).
Prints prompt tokens computed (prompt minus the server's `cached_tokens`),
TTFT p50/p90 (the request's latency: a one-token completion) and prompt
tokens per second.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/mlx_lm_server_tiers.py --sessions 8 --turns 3 --system 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_serve import build_word_tokenizer, free_port  # noqa: E402
from compare_tiers import BLOCK, add_workload_args, device_pages, model, workload  # noqa: E402


def build_dir(path: Path, layers: int):
    from mlx_lm.utils import save_config, save_model

    m = model(layers)
    tokenizer = build_word_tokenizer(path, vocab_size=m.args.vocab_size)
    save_model(path, m)
    # transformers' config validation refuses the unset (None) fields
    config = {k: v for k, v in vars(m.args).items() if v is not None and not k.startswith("_")}
    config["max_position_embeddings"] = 16384
    save_config(config, path / "config.json")
    return m, tokenizer


def text_of(tokenizer, prompt: list[int]) -> str:
    text = " ".join(tokenizer.convert_ids_to_tokens(prompt))
    again = tokenizer.encode(text, add_special_tokens=False)
    if again != prompt:
        raise SystemExit("the word tokenizer does not give the prompt's ids back")
    return text


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    turns = workload(args)
    num_blocks = device_pages(args, turns)
    with tempfile.TemporaryDirectory() as folder:
        m, tokenizer = build_dir(Path(folder), args.layers)
        a = m.args
        page = 2 * a.num_hidden_layers * a.num_key_value_heads * (
            a.hidden_size // a.num_attention_heads) * BLOCK * 4
        budget = num_blocks * page
        texts = [text_of(tokenizer, p) for _, p in turns]
        port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", folder, "--port", str(port),
               "--prompt-cache-bytes", str(budget), "--prompt-cache-size", "1000",
               "--log-level", "WARNING"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ))
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            wait(url)
            run(url, turns, texts, budget)
        finally:
            proc.terminate()
            proc.wait()


def wait(url: str) -> None:
    for _ in range(600):
        try:
            post(url, {"prompt": "w4000", "max_tokens": 1})
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("mlx_lm.server did not start")


def run(url: str, turns, texts: list[str], budget: int) -> None:
    ttfts, computed, total = [], 0, 0
    begin = time.perf_counter()
    for (_, prompt), text in zip(turns, texts):
        start = time.perf_counter()
        reply = post(url, {"prompt": text, "max_tokens": 1, "temperature": 0.0})
        ttfts.append(time.perf_counter() - start)
        usage = reply["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if usage["prompt_tokens"] != len(prompt):
            raise SystemExit(f"server counted {usage['prompt_tokens']} tokens, not {len(prompt)}")
        computed += len(prompt) - cached
        total += len(prompt)
    seconds = time.perf_counter() - begin
    q = statistics.quantiles(ttfts, n=10)
    print(f"mlx_lm.server, prompt cache {budget / 2**20:.0f} MiB")
    print(f"| mlx_lm.server | {computed} | {total} | {statistics.median(ttfts):.3f} "
          f"| {q[8]:.3f} | {total / seconds:.0f} |")


if __name__ == "__main__":
    main()
