"""The simulator's prediction of `benchmarks/compare_tiers.py`'s runs.

Writes the very workload `compare_tiers.py` serves (same token ids, same
round-robin order, one request at a time: every request follows the
previous one with no think time, one output token) as a trace, and runs
`blockmgr simulate` on it three times with the same device pool: device
only, + a host tier, + a disk tier (the real run's budgets, in pages).
Prints prompt tokens computed, TTFT p50/p90 and prompt tokens per second
of each, to set beside the real run's table. The cost terms come from
the command line (`--cost`, measured on the real run: see BENCHMARKS.md).

    python benchmarks/simulate_tiers.py --sessions 8 --turns 3 --system 2048 \\
        --turn-tokens 256 --cost prefill_per_token=...,disk_load_per_page=...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_tiers import BLOCK, CHUNK, add_workload_args, device_pages, workload  # noqa: E402


def write_trace(path: Path, turns) -> None:
    with path.open("w") as f:
        f.write(json.dumps({"type": "header", "version": 1, "vocab_size": 4096}) + "\n")
        for i, (_, prompt) in enumerate(turns):
            record = {"id": f"t{i}", "prompt_tokens": prompt, "output_len": 1}
            if i:
                record["after"] = f"t{i - 1}"  # one chain: the real run's order, serially
            f.write(json.dumps(record) + "\n")


def simulate(trace: Path, out: Path, num_blocks: int, cost: str, tiers: list[str]) -> dict:
    cmd = ["blockmgr", "simulate", "--trace", str(trace), "--arrival", "closed",
           "--concurrency", "1", "--num-blocks", str(num_blocks), "--block-size", str(BLOCK),
           "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "1", "--no-plots",
           "--no-progress", "--out", str(out), "--json", "--check", "--cost", cost, *tiers]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    parser.add_argument("--host-pages", type=int, default=32768)  # 4 GiB of 128 KiB pages
    parser.add_argument("--disk-pages", type=int, default=65536)  # 8 GiB
    parser.add_argument("--cost", default="step_overhead=0")
    args = parser.parse_args()
    turns = workload(args)
    num_blocks = device_pages(args, turns)
    runs = {"device only": [], "+ host": ["--num-host-cache-blocks", str(args.host_pages)],
            "+ disk": ["--num-disk-blocks", str(args.disk_pages)]}
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "tiers.jsonl"
        write_trace(trace, turns)
        print(f"device pool {num_blocks} pages; cost {args.cost}")
        print("| run (simulated) | prompt tokens computed | TTFT p50 s | TTFT p90 s |"
              " prompt tok/s | pages loaded host/disk |")
        print("|---|---|---|---|---|---|")
        for name, tiers in runs.items():
            report = simulate(trace, Path(folder) / "out", num_blocks, args.cost, tiers)
            print_row(name, report, sum(len(p) for _, p in turns))


def print_row(name: str, report: dict, prompt_tokens: int) -> None:
    ttft = report["latency"]["ttft_s"]
    cache = report["prefix_cache"]
    computed = cache["query_tokens"] - cache["hit_tokens"]
    tiers = cache.get("tiers", {})
    loaded = "/".join(str(tiers.get(t, {}).get("pages_loaded_from", "-"))
                      for t in ("host", "disk"))
    seconds = report["throughput"]["simulated_seconds"]
    print(f"| {name} | {computed} | {ttft['p50']:.3f} | {ttft['p90']:.3f} "
          f"| {prompt_tokens / seconds:.0f} | {loaded} |")

if __name__ == "__main__":
    main()
