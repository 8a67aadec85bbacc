"""The prefix cache's tiers on an agent workload that does not fit the device.

Sessions share a long system prompt and grow a history turn by turn; they
are served round-robin, so the device pool (about four sessions' contexts)
keeps only the most recent ones. Side by side in one run, on the same
random-weight model (a llama of realistic layer shapes, float32 on the
CPU): the device cache only, + a host tier, + a disk tier (no host tier),
and a host tier too small for the workload (it fills) over a disk tier.
Per run: prompt tokens computed, TTFT p50 / p90 (allocate + the prompt's
forward), prompt tokens per second. Then a restart: the disk run's cache is
closed (everything flushed) and a new cache opened on its directory; the
first turn of a resumed session is timed against a cold cache, with the
disk read cost per token.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/compare_tiers.py [--sessions 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from blockmgr.ops import Tier
from cache import PagedCache

BLOCK = 16
CHUNK = 512


def model(layers: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=1024, num_hidden_layers=layers,
        intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
        rms_norm_eps=1e-5, vocab_size=4096)
    mx.random.seed(0)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 4096, n).tolist()


def serve(pc: PagedCache, m, seq_id: str, prompt: list[int]) -> tuple[float, int]:
    """TTFT (allocate + the uncached part's forward, in chunks) and tokens computed."""
    begin = time.perf_counter()
    n = pc.allocate(seq_id, prompt).num_cached_tokens
    computed = len(prompt) - n
    while n < len(prompt):
        chunk = prompt[n:n + CHUNK]
        with pc.step([seq_id]) as views:
            out = m(mx.array([chunk]), cache=views)
        mx.eval(out[:, -1])
        n += len(chunk)
    ttft = time.perf_counter() - begin
    pc.free(seq_id)
    return ttft, computed


def workload(args) -> list[tuple[int, list[int]]]:
    """(session, prompt) of every turn, round-robin over sessions."""
    system = tokens(1, args.system)
    history = {s: [] for s in range(args.sessions)}
    turns = []
    for turn in range(args.turns):
        for s in range(args.sessions):
            history[s] += tokens(1000 * s + turn, args.turn_tokens)
            turns.append((s, system + history[s]))
    return turns


def run(name: str, pc: PagedCache, m, turns) -> dict:
    ttfts, computed, total = [], 0, 0
    begin = time.perf_counter()
    for i, (_, prompt) in enumerate(turns):
        ttft, n = serve(pc, m, f"t{i}", prompt)
        ttfts.append(ttft)
        computed += n
        total += len(prompt)
    seconds = time.perf_counter() - begin
    q = statistics.quantiles(ttfts, n=10)
    hits = pc.tiers.counters.hit_tokens if pc.tiers is not None else None
    return {"run": name, "computed": computed, "prompt": total, "p50": statistics.median(ttfts),
            "p90": q[8], "tok_s": total / seconds, "seconds": seconds, "hits": hits}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The agent workload's options (`workload` reads them)."""
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=256)


def device_pages(args: argparse.Namespace, turns: list) -> int:
    """The device pool: the shared system prompt once plus about four
    sessions' longest histories (the runs compared with it use the same)."""
    longest = max(len(p) for _, p in turns)
    return (args.system + 4 * (longest - args.system)) // BLOCK + 8


def main() -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--resume-tokens", type=int, default=4096)
    parser.add_argument("--filling-host-size", default="16MiB",
                        help="the host tier of the host + disk run: smaller than what the "
                             "workload demotes, so it fills and spills to disk")
    args = parser.parse_args()
    m = model(args.layers)
    turns = workload(args)
    # the device holds about four sessions' contexts (their shared prompt once)
    num_blocks = device_pages(args, turns)
    common = dict(num_blocks=num_blocks, block_size=BLOCK)
    rows = []
    rows.append(run("device only", PagedCache.for_model(m, **common), m, turns))
    rows.append(run("+ host", PagedCache.for_model(m, host_cache_size="4GiB", **common), m, turns))
    with tempfile.TemporaryDirectory() as folder:
        pc = PagedCache.for_model(m, disk_cache=folder, disk_cache_size="8GiB", **common)
        rows.append(run("+ disk", pc, m, turns))
        pc.close()
        with tempfile.TemporaryDirectory() as spill:
            pc = PagedCache.for_model(m, host_cache_size=args.filling_host_size,
                                      disk_cache=spill, disk_cache_size="8GiB", **common)
            rows.append(run(f"+ host {args.filling_host_size} + disk", pc, m, turns))
            pc.close()
        print_rows(args, num_blocks, rows)
        restart(args, m, common, folder)


def print_rows(args, num_blocks, rows) -> None:
    print(f"{args.sessions} sessions x {args.turns} turns, system prompt {args.system}, "
          f"{args.turn_tokens} tokens a turn, device pool {num_blocks} pages of {BLOCK}")
    print("| run | prompt tokens computed | of | TTFT p50 s | TTFT p90 s | prompt tok/s |"
          " hit tokens device/host/disk |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['computed']} | {r['prompt']} | {r['p50']:.3f} | {r['p90']:.3f} "
              f"| {r['tok_s']:.0f} | {r['hits'] or '-'} |")


def restart(args, m, common, folder) -> None:
    """A resumed session of `resume_tokens` after a restart, against cold."""
    context = tokens(7, args.resume_tokens)
    # a pool that holds the resumed session (the workload's may be smaller)
    pages = max(common["num_blocks"], (args.resume_tokens + 64) // BLOCK + 8)
    common = {**common, "num_blocks": pages}
    with PagedCache.for_model(m, disk_cache=folder, disk_cache_size="8GiB", **common) as pc:
        serve(pc, m, "w", context)  # the session's earlier turn, cached then flushed at close
    pc = PagedCache.for_model(m, disk_cache=folder, disk_cache_size="8GiB", **common)
    resumed = context + tokens(8, 32)
    warm, computed = serve(pc, m, "r", resumed)
    disk = pc.tiers.disk.stats if pc.tiers.disk is not None else None
    hit = pc.tiers.counters.hit_tokens[Tier.DISK]
    pc.close()
    cold_pc = PagedCache.for_model(m, **common)
    cold, _ = serve(cold_pc, m, "c", resumed)
    read_s = disk.read_seconds if disk else float("nan")
    print(f"\nrestart: first turn of a resumed {len(resumed)}-token session: "
          f"{warm:.3f} s from disk ({hit} tokens hit, {computed} computed) vs {cold:.3f} s cold "
          f"= {cold / warm:.1f}x; disk reads {read_s * 1e3:.1f} ms "
          f"for {disk.read_nbytes / 2**20:.0f}"
          f" MiB = {read_s / max(hit, 1) * 1e6:.1f} us per token")


if __name__ == "__main__":
    main()
