"""`blockmgr serve` beside `mlx_lm.server`, same model directory, same load,
driven by `blockmgr bench`.

Builds a Qwen3-0.6B-shaped model (hidden 1024, 16 heads / 8 KV heads of
128, vocabulary 151936; `--layers` layers, random float32 weights) with a
word-level tokenizer of the same size built locally (every id decodes to a
word: `build_word_tokenizer`), writes it in mlx-lm's format and
two traces with the simulator's workload generator (closed loop, no arrival
times): `shared` (chat on one system prompt of `--system-words` words, a
short unique question each) and `multiturn` (conversations of 4 turns on
the same kind of system prompt, every turn resending the history). Then for
each workload and server: starts the server on 127.0.0.1 (a subprocess, the
same environment, so the same BLAS), warms it up with two requests, runs
`blockmgr bench --trace ... --concurrency C` (streaming chat, greedy,
`--max-tokens` outputs) and reports output tokens/s, TTFT p50/p99, the
server-reported cached prompt tokens and the server's peak RSS (VmHWM).
`--repeat N` runs the servers N times per workload in alternating order
and prints each run and the throughput ratios to `mlx_lm.server`.
The bench reports are kept under `--out`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/compare_serve.py --requests 32 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.serving.loadgen import WORDS  # noqa: E402
from tests.serve_model import CHAT_TEMPLATE, EOS  # noqa: E402

VOCAB = 151936


def build_word_tokenizer(path: Path, vocab_size: int = VOCAB):
    """A word-level tokenizer as large as the model's vocabulary: the
    chat-template markers, the load generator's words (one token each), then
    "w<i>" up to `vocab_size`, so every token id the model samples decodes to
    a word and both servers stream a text delta per token (a smaller
    tokenizer leaves most ids without text, and `mlx_lm.server` sends no
    chunk for them, which hides its first token from the client)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + ["[UNK]"] + list(dict.fromkeys(WORDS)))}
    vocab.update((f"w{i}", i) for i in range(len(vocab), vocab_size))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="[UNK]",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def qwen3_config(layers: int) -> dict:
    """Qwen3-0.6B's layer shape with `layers` layers."""
    return {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": layers,
            "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "max_position_embeddings": 40960, "rope_theta": 1e6, "tie_word_embeddings": True}


def qwen3_model(layers: int):
    """The model of `qwen3_config`, random float32 weights (seed 0)."""
    from mlx_lm.models import qwen3

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(qwen3_config(layers)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def build_qwen3_dir(path: Path, layers: int) -> Path:
    from mlx_lm.utils import save_config, save_model

    build_word_tokenizer(path)
    config = qwen3_config(layers)
    model = qwen3_model(layers)
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
          kv_memory: str, prefill_batch: int = 1, root: Path = ROOT) -> subprocess.Popen:
    if kind.startswith("blockmgr"):
        cmd = [sys.executable, "-m", "scheduler.cli", "serve", "--model", str(model_dir),
               "--port", str(port), "--kv-memory", kv_memory,
               "--max-num-seqs", str(max(64, concurrency))]  # a row for every client
        if kind == "blockmgr" or prefill_batch != 1:  # (a baseline may not have the option)
            cmd += ["--prefill-batch", str(prefill_batch)]
    else:
        options = ["--model", str(model_dir), "--port", str(port), "--log-level", "WARNING"]
        if kind == "mlx_lm-default":  # mlx_lm.server's own defaults
            cmd = [sys.executable, "-m", "mlx_lm", "server", *options]
        else:  # tuned to the clients: rows, prompts and a listen backlog for every client
            cmd = [sys.executable, str(ROOT / "benchmarks" / "mlx_lm_server_backlog.py"),
                   str(max(128, 2 * concurrency)), *options,
                   "--decode-concurrency", str(concurrency),
                   "--prompt-concurrency", str(concurrency)]
    return subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(root)})


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


def write_traces(folder: Path, num_requests: int, system_words: int, max_tokens: int,
                 turns: int = 4) -> dict[str, Path]:
    """The two workloads as trace files (the simulator's generator, closed loop)."""
    from scheduler.simulator.lengths import LengthDist
    from scheduler.simulator.trace import write_trace
    from scheduler.simulator.workloads import WorkloadConfig, generate

    common = dict(num_requests=num_requests, arrival="closed", num_system_prompts=1,
                  user_len=LengthDist("fixed", 12), output_len=LengthDist("fixed", max_tokens),
                  think_time=0.0, seed=0)
    configs = {
        "shared": WorkloadConfig(mix={"chat": 1.0}, system_len=LengthDist("fixed", system_words),
                                 **common),
        "multiturn": WorkloadConfig(mix={"multiturn": 1.0}, turns=LengthDist("fixed", turns),
                                    system_len=LengthDist("fixed", system_words // 4), **common),
    }
    paths = {}
    for name, config in configs.items():
        paths[name] = folder / f"{name}.jsonl"
        write_trace(paths[name], generate(config), {"vocab_size": 32000,
                                                    "workload": config.to_dict()})
    return paths


def bench(url: str, model: str, trace: Path, concurrency: int, out: Path) -> dict:
    """`blockmgr bench` as a subprocess; its report's summary."""
    cmd = [sys.executable, "-m", "scheduler.cli", "bench", "--url", url, "--model", model,
           "--trace", str(trace), "--concurrency", str(concurrency), "--out", str(out),
           "--no-progress", "--json"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads((out / "report.json").read_text())["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=400,
                        help="words (= tokens) of the shared system prompt")
    parser.add_argument("--servers", default="blockmgr,mlx_lm",
                        help="blockmgr, mlx_lm (decode and prompt concurrency set to "
                             "--concurrency, a listen backlog for every client: "
                             "benchmarks/mlx_lm_server_backlog.py), mlx_lm-default "
                             "(mlx_lm.server's own defaults)")
    parser.add_argument("--kv-memory", default="256MiB", help="blockmgr serve's page pool")
    parser.add_argument("--prefill-batch", default="1",
                        help="blockmgr serve's prefill chunks per forward; several values "
                             "(1,8) run it once per value")
    parser.add_argument("--workloads", default="shared,multiturn")
    parser.add_argument("--baseline", metavar="DIR",
                        help="another checkout whose blockmgr serve also runs (e.g. a "
                             "`git archive` of an earlier commit)")
    parser.add_argument("--out", default="serve-bench", help="folder for the bench reports")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every server this many times per workload, the order reversed "
                             "each time; prints the throughput ratios per repeat and their median")
    args = parser.parse_args()
    blas = "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "") else \
        "bundled reference BLAS"
    print(f"# {platform.machine()} {os.cpu_count()} cores, mlx {mx.__version__}, {blas}")
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_qwen3_dir(Path(tmp) / "qwen3-shape", args.layers)
        traces = write_traces(Path(tmp), args.requests, args.system_words, args.max_tokens)
        (Path(tmp) / "warm").mkdir()
        warmup = write_traces(Path(tmp) / "warm", 2, args.system_words, 4)
        print("| workload | server | output tok/s | TTFT p50 (s) | TTFT p99 (s) | "
              "cached prompt tokens | peak RSS (MiB) | failed requests |")
        print("|---|---|---|---|---|---|---|---|")
        kinds = args.servers.split(",")
        if args.baseline:
            kinds.insert(0, "blockmgr-baseline")
        runs = [(kind, int(batch)) for kind in kinds
                for batch in (args.prefill_batch.split(",") if kind == "blockmgr" else [1])]
        ratios: dict[tuple[str, str], list[float]] = {}
        for name in args.workloads.split(","):
            for repeat in range(args.repeat):  # ABC, CBA, ...: load drift falls on all alike
                rates = {}
                for kind, batch in (runs if repeat % 2 == 0 else runs[::-1]):
                    blockmgr = kind.startswith("blockmgr")
                    label = f"{kind} --prefill-batch {batch}" if blockmgr else kind
                    root = Path(args.baseline) if kind == "blockmgr-baseline" else ROOT
                    port = free_port()
                    proc = start(kind, model_dir, port, args.concurrency, args.kv_memory, batch,
                                 root)
                    url = f"http://127.0.0.1:{port}"
                    try:
                        wait_up(url, proc)
                        model = model_dir.name if blockmgr else str(model_dir)
                        tag = f"{name}-{kind}" + (f"-pb{batch}" if blockmgr else "")
                        bench(url, model, warmup[name], 1, out / f"warmup-{tag}")
                        s = bench(url, model, traces[name], args.concurrency, out / tag)
                        rss = peak_rss(proc.pid)
                    finally:
                        proc.terminate()
                        try:
                            proc.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
                    lat = s["latency"]["ttft_s"]
                    rates[label] = s["throughput"]["output_tokens_per_s"]
                    print(f"| {name} | {label} | {rates[label]:.1f} | "
                          f"{lat['p50']:.3f} | {lat['p99']:.3f} | "
                          f"{s['prefix_cache']['hit_rate'] * 100:.0f} % | {rss / 2**20:.0f} | "
                          f"{s['requests']['aborted']} of {s['requests']['submitted']} |",
                          flush=True)
                peers = [label for label in rates if label.startswith("mlx_lm")]
                for label, rate in rates.items():
                    for peer in peers:
                        if label not in peers:
                            ratios.setdefault((name, label, peer), []).append(rate / rates[peer])
        for (name, label, peer), values in ratios.items():
            each = ", ".join(f"{v:.2f}x" for v in values)
            print(f"{name}: {label} / {peer} throughput, per repeat: {each}; "
                  f"median {statistics.median(values):.2f}x")


if __name__ == "__main__":
    main()
