"""Side by side: a chat request's block-manager calls in two checkouts.

Run: python benchmarks/request_lifecycle.py BASE_DIR [--rounds 8] [-n 20000]

Each round runs, once from BASE_DIR and once from this checkout (order
alternating; the machine is shared), a loop shaped like a chat simulation's
per-request path: `allocate` of a prompt (one of 8 shared 600-token system
prompts + 120 tokens of its own) into a 4,096-page pool that the prefix
cache keeps full (so most admissions evict), `cache_prefix` of the prompt,
`append` of a 100-token answer, and `free` 40 requests later. It prints
the best and the median CPU microseconds per request of each call, and the
ratios (this checkout / base). The simulated workload's other per-request
work (generation, `Request`s, the scheduler) is not in it:
`compare_simulate_cpu.py` measures the whole run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
CALLS = ("allocate", "cache_prefix", "free")

_CHILD = r"""
import json, random, sys, time
from blockmgr import BlockManager, BlockManagerConfig
num_requests = int(sys.argv[1])
random.seed(0)
bm = BlockManager(BlockManagerConfig(num_blocks=4096, block_size=16))
systems = [[random.randrange(32000) for _ in range(600)] for _ in range(8)]
prompts = [systems[i % 8] + [random.randrange(32000) for _ in range(120)]
           for i in range(num_requests)]
answers = [[random.randrange(32000) for _ in range(100)] for _ in range(200)]
spent = dict.fromkeys(("allocate", "cache_prefix", "free"), 0.0)
clock = time.process_time
live = []
for i in range(num_requests):
    t = clock(); bm.allocate(i, prompts[i]); spent["allocate"] += clock() - t
    t = clock(); bm.cache_prefix(i); spent["cache_prefix"] += clock() - t
    bm.append(i, answers[i % 200])
    live.append(i)
    if len(live) > 40:
        seq_id = live.pop(0)
        t = clock(); bm.free(seq_id); spent["free"] += clock() - t
bm.check_integrity()
print(json.dumps({k: v / num_requests * 1e6 for k, v in spent.items()}))
"""


def run_once(checkout: Path, num_requests: int) -> dict[str, float]:
    """CPU microseconds per request of each call, from `checkout`'s code."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(num_requests)],
        cwd=checkout, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("-n", type=int, default=20000, dest="num_requests")
    args = parser.parse_args()
    base, this = {c: [] for c in CALLS}, {c: [] for c in CALLS}
    for round_index in range(args.rounds):
        order = [(args.base, base), (HERE, this)]
        if round_index % 2:
            order.reverse()
        for checkout, into in order:
            for call, value in run_once(checkout, args.num_requests).items():
                into[call].append(value)
    for call in (*CALLS, "total"):
        b = base[call] if call != "total" else [sum(v) for v in zip(*base.values())]
        t = this[call] if call != "total" else [sum(v) for v in zip(*this.values())]
        print(f"{call:13s} best base {min(b):6.1f} us  this {min(t):6.1f} us"
              f"  ratio {min(t) / min(b):.2f}   median base {statistics.median(b):6.1f}"
              f"  this {statistics.median(t):6.1f}"
              f"  ratio {statistics.median(t) / statistics.median(b):.2f}")


if __name__ == "__main__":
    main()
