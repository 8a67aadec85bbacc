"""Admission prefetch against reads at allocation, side by side in one run.

Agent sessions (a long context each) go through an `Engine` whose device
pool holds about three of them, with a disk tier: a first round caches them
all (most end up on disk), the disk's writes are synced and the OS's
cached copies of its files dropped (cold reads, as after a restart), then
every session sends a next turn at once. With `num_prefetch_ahead = 0`
each admission reads its records itself, between forwards; with 4 the next
waiting requests' records are read on a background thread during the
running requests' forwards. Reported per mode (the modes alternate, each
`--repeats` times, on the same random-weight llama, float32 on the CPU):
the second round's wall time, TTFT p50 / p90, the disk read time, and the
ratios prefetch / inline.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/compare_prefetch.py [--sessions 8] [--context 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from compare_tiers import model  # the same random llama (run from benchmarks/'s parent)

from blockmgr.ops import Tier
from scheduler import Engine, SamplingParams

BLOCK = 16


def drop_os_cache(directory: Path) -> None:
    """Ask the OS to forget its cached copies of the disk tier's files."""
    for path in directory.glob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(m, sessions: list[list[int]], ahead: int, num_blocks: int) -> dict:
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with tempfile.TemporaryDirectory(prefix="prefetch-bench-") as tmp:
        with Engine(m, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=2,
                    max_num_batched_tokens=512, disk_cache=tmp,
                    disk_cache_size="2GiB") as engine:
            engine.num_prefetch_ahead = ahead
            engine.generate(sessions, params)
            tiers = engine.cache.tiers
            tiers.disk.sync()
            drop_os_cache(Path(tmp))
            load_before = tiers.counters.load_seconds[Tier.DISK]
            begin = time.perf_counter()
            outs = engine.generate([s + [1, 2, 3] for s in sessions], params)
            wall = time.perf_counter() - begin
            ttfts = sorted(o.metrics.time_to_first_token for o in outs)
            disk_hits = sum(o.metrics.cached_tokens_by_tier[Tier.DISK] for o in outs)
            return {"wall": wall, "p50": statistics.median(ttfts),
                    "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
                    "load": tiers.counters.load_seconds[Tier.DISK] - load_before,
                    "disk_hits": disk_hits, "prefetched": tiers.num_prefetched,
                    "tokens": [o.tokens for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    m = model(args.layers)
    rng = np.random.default_rng(0)
    sessions = [rng.integers(0, 4096, args.context).tolist() for _ in range(args.sessions)]
    num_blocks = 3 * (args.context // BLOCK + 2)  # about three sessions' contexts
    run(m, sessions[:3], 0, num_blocks)  # warm-up: MLX's first kernels, the allocator
    results: dict[int, list[dict]] = {0: [], 4: []}
    for _ in range(args.repeats):
        for ahead in (0, 4):
            results[ahead].append(run(m, sessions, ahead, num_blocks))
    assert results[0][0]["tokens"] == results[4][0]["tokens"], "prefetch changed the outputs"
    print(f"{args.sessions} sessions of {args.context} tokens, {args.layers} layers, "
          f"device pool {num_blocks} pages of {BLOCK}; second round, cold disk reads; "
          f"best of {args.repeats}")
    print("| mode | round wall, s | TTFT p50, s | TTFT p90, s | disk read, s | "
          "disk-hit tokens | records read ahead |")
    print("|---|---|---|---|---|---|---|")
    best = {}
    for ahead, name in ((0, "read at allocation"), (4, "prefetch (4 ahead)")):
        r = min(results[ahead], key=lambda x: x["wall"])
        best[ahead] = r
        print(f"| {name} | {r['wall']:.3f} | {r['p50']:.3f} | {r['p90']:.3f} | "
              f"{r['load']:.4f} | {r['disk_hits']} | {r['prefetched']} |")
    print(f"prefetch / inline: wall {best[4]['wall'] / best[0]['wall']:.3f}, "
          f"TTFT p50 {best[4]['p50'] / best[0]['p50']:.3f}, "
          f"p90 {best[4]['p90'] / best[0]['p90']:.3f}")


if __name__ == "__main__":
    main()
