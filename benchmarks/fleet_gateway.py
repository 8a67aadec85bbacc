"""Three `blockmgr serve` replicas behind the Shepherd Model Gateway, one
run per routing policy (round_robin, cache_aware, ...), same workload.

Builds a small Qwen3-shaped model (`--hidden`, `--layers`, a word-level
vocabulary of `--vocab` ids, random float32 weights; benchmarks/compare_serve.py's
tokenizer), then per policy starts a fresh fleet (`tests/fleet.py`: the
replicas, then `smg launch --policy P`; cold caches), runs `blockmgr bench`
against the gateway on the multi-session workload (multi-turn conversations
on `--num-system-prompts` system prompts, every turn resending its history,
closed loop) and reads each replica's /metrics at the end. Reported per
policy: prompt tokens computed (prompt - cached, summed over replicas), the
prefix hit rate (cached / prompt tokens), TTFT p50 / p90 and throughput as
the client saw them, and how the requests spread over the replicas.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/fleet_gateway.py --requests 96 --concurrency 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare_serve import build_word_tokenizer  # noqa: E402
from tests.fleet import Fleet, httpx  # noqa: E402

POLICIES = ("round_robin", "cache_aware")


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A Qwen3-shaped model (heads of 64, KV heads half the heads) and its
    word-level tokenizer, random float32 weights (seed 0), in mlx-lm's format."""
    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model

    path.mkdir(parents=True, exist_ok=True)
    build_word_tokenizer(path, vocab)
    heads = hidden // 64
    config = {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": 3 * hidden, "num_attention_heads": heads,
              "num_key_value_heads": max(1, heads // 2), "head_dim": 64, "rms_norm_eps": 1e-6,
              "vocab_size": vocab, "max_position_embeddings": 8192, "rope_theta": 1e6,
              "tie_word_embeddings": True}
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def counter(metrics: str, name: str) -> float:
    """The sum of a family's samples in a Prometheus text (labels ignored)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def add_fleet_options(parser: argparse.ArgumentParser) -> None:
    """The fleet's, the model's and the multi-session workload's options."""
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=6, help="closed-loop clients")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-system-prompts", type=int, default=8)
    parser.add_argument("--workload-seed", type=int, default=0,
                        help="the workload's --seed (its sessions' token ids)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--kv-memory", default="256MiB", help="each replica's KV pool")


def workload_args(args: argparse.Namespace) -> list[str]:
    """The multi-session workload's options, as `blockmgr bench` and
    `blockmgr simulate` both read them."""
    return ["--workload", "multiturn", "-n", str(args.requests), "--arrival", "closed",
            "--concurrency", str(args.concurrency), "--system-len", f"fixed:{args.system_len}",
            "--user-len", f"fixed:{args.user_len}", "--output-len", f"fixed:{args.output_len}",
            "--turns", f"fixed:{args.turns}", "--think-time", "0",
            "--num-system-prompts", str(args.num_system_prompts),
            "--seed", str(args.workload_seed)]


def run_policy(args: argparse.Namespace, model_dir: Path, policy: str, out: Path) -> dict:
    serve_args = ("--kv-memory", args.kv_memory, "--block-size", "16",
                  "--max-num-seqs", str(args.concurrency), "--status-interval", "0")
    with Fleet(model_dir, args.replicas, policy, out / "logs", serve_args=serve_args,
               timeout=300) as fleet:
        cmd = [sys.executable, "-m", "scheduler.cli", "bench", "--url", fleet.url,
               "--model", "model", *workload_args(args), "--vocab-size", str(args.vocab),
               "--out", str(out / "bench"), "--no-progress", "--no-plots", "--json"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        metrics = [httpx.get(url + "/metrics", timeout=10).text for url in fleet.replica_urls]
    summary = json.loads((out / "bench" / "report.json").read_text())["summary"]
    prompt = sum(counter(m, "blockmgr_prompt_tokens_total") for m in metrics)
    cached = sum(counter(m, "blockmgr_cached_prompt_tokens_total") for m in metrics)
    lat, thr = summary["latency"], summary["throughput"]
    return {"policy": policy, "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_prompt_tokens": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": lat["ttft_s"]["p50"], "ttft_p90_s": lat["ttft_s"]["p90"],
            "output_tokens_per_s": thr["output_tokens_per_s"],
            "requests_per_s": thr["requests_per_s"],
            "requests_per_replica": [counter(m, "blockmgr_requests_finished_total")
                                     for m in metrics],
            "finished": summary["requests"]["finished"],
            "submitted": summary["requests"]["submitted"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="SMG policies, comma-separated (default round_robin,cache_aware)")
    add_fleet_options(parser)
    parser.add_argument("--out", default="fleet-bench", help="folder for reports and logs")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        rows = [run_policy(args, model_dir, policy, out / policy)
                for policy in args.policies.split(",")]
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    print(f"{args.replicas} replicas, {args.requests} requests, {args.concurrency} clients, "
          f"multiturn {args.turns} turns, system {args.system_len} / user {args.user_len} / "
          f"output {args.output_len} tokens, {args.num_system_prompts} system prompts")
    print("| policy | prompt tokens computed | hit rate | TTFT p50 / p90 s | out tok/s | req/s "
          "| requests per replica |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        spread = " / ".join(f"{n:.0f}" for n in r["requests_per_replica"])
        print(f"| {r['policy']} | {r['computed_prompt_tokens']:.0f} of {r['prompt_tokens']:.0f} "
              f"| {r['hit_rate'] * 100:.1f} % | {r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} "
              f"| {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | {spread} |")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
