"""Block manager (`blockmgr/`) micro-benchmarks: one table of us per op.

Run: python benchmarks/blockmgr_table.py [--repeats 7] [--scale 1.0] [--only d1,g2]
[--interleave] [--cpu-time]

Every case is built by a factory that returns a fresh state and a `run`
callable doing one unit of work (one get+free, one decode step over 256
sequences, one request lifecycle, ...). The table times `calls` consecutive
calls with `time.perf_counter`, keeps the best of several repeats (each on a
fresh state) and divides by the work units per call. `bench_blockmgr.py`
runs the same cases under pytest-benchmark.

Queried prompts are new int objects equal to the cached ones, as a
tokenizer produces them (see `tokens`); case e7 shows the faster, unrealistic
compare of identical objects.

Reference column: vLLM 0.33's KV cache manager measured on the same kind of
machine (figures from the issues; vLLM cannot be installed here as a peer):
~1.4 us per 1-block get+free, 4-8 us per decode `allocate_slots`, 50-90 us
per 512-token request lifecycle, 44-72 us for a 512-token request with 496
tokens hit. vLLM hashes blocks (sha256) and caches only full blocks.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

# Time the checkout this file belongs to, not another copy of `blockmgr`
# installed in the environment (as an editable install of a sibling worktree
# would be): run as a script, only benchmarks/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockmgr import BlockManager, BlockManagerConfig, GroupedStore, GroupedStoreConfig
from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import PrefixTrie

BLOCK = 16
NUM_DECODE_SEQS = 256
PROMPT = 512
PREFIX_HIT = 496
ONE_TOKEN = [7]
TOKEN_BASE = 1000


@dataclass
class Bench:
    """A ready state: `run()` does `units` units of work on it."""

    run: Callable[[], object]
    units: float


@dataclass(frozen=True)
class Case:
    """One row of the table.

    make(num_calls) builds a fresh state with room for `num_calls` calls of
    its `run`. `calls` is how many calls one timed repeat makes (the pytest
    benchmark uses `iterations` per round). `target_us` is per unit.
    """

    key: str
    group: str
    name: str
    unit: str
    make: Callable[[int], Bench]
    calls: int
    iterations: int
    target_us: float | None = None
    vllm: str = ""


# ------------------------------------------------------------------ helpers


def tokens(num_tokens: int, first: int = TOKEN_BASE) -> list[int]:
    """`num_tokens` token ids, as new int objects on every call.

    A tokenizer hands the manager fresh int objects. Comparing two equal
    lists whose ints are the very same objects takes CPython's identity
    shortcut and is ~5x faster than comparing equal, distinct ints, so a
    benchmark that reuses one prompt list for both the cached and the
    queried tokens flatters every trie walk. Ids start above 256 (CPython
    caches small ints), like real vocabulary ids.
    """
    return list(range(first, first + num_tokens))


def unique_prompts(count: int, length: int, first_token: int = 10_000_000) -> list[list[int]]:
    """`count` prompts of `length` tokens sharing no token with each other."""
    return [tokens(length, first_token + i * length) for i in range(count)]


#: Layer groups of the grouped-store cases: one full-attention group (what a
#: plain manager keeps), gemma3's (full + a 1024-token window) and gpt-oss's
#: (full + a 128-token window).
LAYOUTS = {"full": (None,), "gemma3": (None, 1024), "gpt_oss": (None, 128)}


def manager(num_blocks: int, prefix_cache: bool = True, layout: str | None = None):
    """An attention-only manager (no recurrent slots) with 16-token pages; a
    `GroupedStore` of the `layout`'s groups (each with `num_blocks` pages)
    when one is named."""
    if layout is not None:
        return GroupedStore(GroupedStoreConfig(
            num_blocks=num_blocks, block_size=BLOCK, windows=LAYOUTS[layout],
            enable_prefix_cache=prefix_cache,
        ))
    return BlockManager(
        BlockManagerConfig(
            num_blocks=num_blocks, block_size=BLOCK, enable_prefix_cache=prefix_cache
        )
    )


def lifecycle(bm: BlockManager, prompts) -> Callable[[], None]:
    """allocate + free of the next prompt from the iterator `prompts`."""
    allocate, free = bm.allocate, bm.free

    def run() -> None:
        allocate("r", next(prompts))
        free("r")

    return run


def pages_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


# ------------------------------------------------ (a) 1-block allocate + free


def make_pool_get_free(num_calls: int) -> Bench:
    """`RefCountedPool.take(1)` + `release_all` of the page taken."""
    pool = RefCountedPool(4096)
    take, release_all = pool.take, pool.release_all

    def run() -> None:
        release_all(take(1))

    return Bench(run, 1)


def make_pool_take_one(num_calls: int) -> Bench:
    """`RefCountedPool.take_one()` + `release` (the scalar fast path)."""
    pool = RefCountedPool(4096)
    take_one, release = pool.take_one, pool.release

    def run() -> None:
        release(take_one())

    return Bench(run, 1)


def make_manager_one_token(prefix_cache: bool) -> Callable[[int], Bench]:
    """`BlockManager.allocate` of a 1-token prompt (one page) + `free`."""

    def make(num_calls: int) -> Bench:
        bm = manager(4096, prefix_cache)
        allocate, free = bm.allocate, bm.free

        def run() -> None:
            allocate("r", ONE_TOKEN)
            free("r")

        return Bench(run, 1)

    return make


# -------------------------------------------------- (b) decode append step


def make_decode(check_first: bool, layout: str | None = None) -> Callable[[int], Bench]:
    """One decode step: `append` one token to each of 256 live sequences.

    Prompts are 64..1024 tokens (seeded), so page boundaries are spread and
    about one sequence in 16 takes a new page per step, as in real decode.
    With `check_first`, each append is preceded by `can_append` (what a
    scheduler asks before it commits the step).
    """

    def make(num_calls: int) -> Bench:
        rng = random.Random(0)
        lengths = [rng.randint(64, 1024) for _ in range(NUM_DECODE_SEQS)]
        num_blocks = sum(pages_for(n + num_calls) for n in lengths) + 16
        bm = manager(num_blocks, layout=layout)
        ids = [f"seq-{i}" for i in range(NUM_DECODE_SEQS)]
        first = 1_000_000
        for seq_id, length in zip(ids, lengths):
            bm.allocate(seq_id, range(first, first + length))
            first += length
        append, can_append = bm.append, bm.can_append
        if check_first:

            def run() -> None:
                for seq_id in ids:
                    if can_append(seq_id, 1):
                        append(seq_id, ONE_TOKEN)

        else:

            def run() -> None:
                for seq_id in ids:
                    append(seq_id, ONE_TOKEN)

        return Bench(run, NUM_DECODE_SEQS)

    return make


# ------------------------------------------- (c) 512-token request lifecycle


def make_request_no_cache(num_calls: int) -> Bench:
    """allocate + free of a 512-token prompt, prefix cache disabled."""
    bm = manager(4096, prefix_cache=False)
    prompt = tokens(PROMPT)
    allocate, free = bm.allocate, bm.free

    def run() -> None:
        allocate("r", prompt)
        free("r")

    return Bench(run, 1)


# ----------------------------------------- (d) 512-token request, 496 hit


def make_request_prefix_hit(num_calls: int, layout: str | None = None) -> Bench:
    """A 512-token request whose first 496 tokens are cached: match +
    allocate + free.

    Each call's last 16 tokens are new (a shared system prompt, a different
    question each time), so every call hits exactly 496 tokens and `free`
    caches its own 16-token tail as a new leaf. The pool has room for every
    tail: no eviction here (that is case f).
    """
    tails = unique_prompts(num_calls + 1, PROMPT - PREFIX_HIT)
    prompts = [tokens(PREFIX_HIT) + tail for tail in tails]
    bm = manager(pages_for(PROMPT) + num_calls + 16, layout=layout)
    bm.allocate("warm", tokens(PREFIX_HIT) + [0])
    bm.free("warm", num_computed=PREFIX_HIT)
    probe = prompts.pop()
    hit = bm.allocate("probe", probe).num_cached_tokens
    bm.free("probe", num_computed=PREFIX_HIT)
    assert hit == PREFIX_HIT, hit
    return Bench(lifecycle(bm, iter(prompts)), 1)


def make_request_repeated(num_calls: int) -> Bench:
    """The same 512-token request again and again (vLLM's usual prefix hit),
    each time as a new token list.

    vLLM hits 496 tokens here (full blocks, capped at n - 1); the trie hits
    511: the 15 tokens of the partial last page are shared too, at the cost
    of a `CopyBlock` of that page.
    """
    bm = manager(4096)
    bm.allocate("warm", tokens(PROMPT))
    bm.free("warm")
    hit = bm.allocate("probe", tokens(PROMPT)).num_cached_tokens
    bm.free("probe")
    assert hit == PROMPT - 1, hit
    prompts = [tokens(PROMPT) for _ in range(num_calls)]
    return Bench(lifecycle(bm, iter(prompts)), 1)


# ------------------------------------------------- (e) trie match vs length


def build_trie(num_tokens: int, branch_every: int | None) -> tuple[PrefixTrie, list[int]]:
    """A trie caching one `num_tokens` prefix; with `branch_every`, a sibling
    branch leaves it every `branch_every` tokens (one node per segment)."""
    pool = RefCountedPool(pages_for(num_tokens) * 2 + 64)
    trie = PrefixTrie(BLOCK, [(pool, None)], None)
    prefix = tokens(num_tokens)
    insert(trie, pool, prefix)
    if branch_every:
        for index, cut in enumerate(range(branch_every, num_tokens, branch_every)):
            insert(trie, pool, prefix[:cut] + [2_000_000 + index])
    return trie, prefix


def insert(trie: PrefixTrie, pool: RefCountedPool, cached: list[int]) -> None:
    """Cache `cached` in fresh pages (the trie keeps only the ones it needs)."""
    pages = pool.take(pages_for(len(cached)))
    trie.insert(None, cached, [pages])
    pool.release_all(pages)


def make_trie_match(
    num_tokens: int, branch_every: int | None, same_objects: bool = False
) -> Callable[[int], Bench]:
    """`PrefixTrie.match` of a query whose first `num_tokens` tokens are cached.

    The query holds new int objects unless `same_objects` (then it reuses
    the cached list's ints: CPython's identity shortcut, a lower bound).
    """

    def make(num_calls: int) -> Bench:
        trie, prefix = build_trie(num_tokens, branch_every)
        query = (prefix if same_objects else tokens(num_tokens)) + [3_000_000]
        match, limit = trie.match, len(query) - 1
        found = match(None, query, limit)
        assert found.num_tokens == num_tokens, found.num_tokens
        assert len(found.path) == (num_tokens // branch_every if branch_every else 1)

        def run() -> None:
            match(None, query, limit)

        return Bench(run, num_tokens / 1000)

    return make


# ------------------------------------------------ (f) eviction under pressure

EVICT_POOL = 1024


def make_evict(prompt_len: int, full: bool) -> Callable[[int], Bench]:
    """allocate + free of a never-seen `prompt_len`-token prompt, prefix cache on.

    full=False: the pool has room for everything, nothing is evicted (each
    free leaves its prompt as a new leaf). full=True: a 1024-page pool is
    kept full of cached leaves of the same size, so every allocate must first
    evict the least recently used leaf (prompts cycle through twice the
    pool's worth, so a prompt is long evicted when it comes back: no hits).
    """

    def make(num_calls: int) -> Bench:
        per_prompt = pages_for(prompt_len)
        if not full:
            bm = manager(num_calls * per_prompt + per_prompt + 16)
            return Bench(lifecycle(bm, iter(unique_prompts(num_calls, prompt_len))), 1)
        bm = manager(EVICT_POOL)
        cycle = unique_prompts(2 * EVICT_POOL // per_prompt, prompt_len)
        prompts = _endless(cycle)
        warm = lifecycle(bm, prompts)
        for _ in range(len(cycle)):
            warm()
        evicted = bm.stats.num_evicted_pages
        warm()
        assert bm.stats.num_evicted_pages == evicted + per_prompt
        assert bm.num_free_blocks == 0
        return Bench(warm, 1)

    return make


def _endless(items: list):
    """Cycle through `items` forever (itertools.cycle, spelled out)."""
    while True:
        yield from items


# ------------------------------------- (s) speculation transaction and swap

NUM_SPECULATING_SEQS = 64


def make_speculation(hybrid: bool) -> Callable[[int], Bench]:
    """One fully rejected speculative round over 64 live sequences:
    `begin_speculation` with 4 drafts each, then `commit_speculation`
    keeping none (the draft pages released; a hybrid sequence gets its
    checkpoint slot back), so every call starts from the same state."""

    def make(num_calls: int) -> Bench:
        num_slots = 3 * NUM_SPECULATING_SEQS if hybrid else 0
        bm = BlockManager(BlockManagerConfig(
            num_blocks=4096, block_size=BLOCK, num_slots=num_slots, enable_prefix_cache=False,
        ))
        seq_ids = [f"s{i}" for i in range(NUM_SPECULATING_SEQS)]
        for i, seq_id in enumerate(seq_ids):
            bm.allocate(seq_id, tokens(100, TOKEN_BASE + 1000 * i))
        drafts = {seq_id: tokens(4) for seq_id in seq_ids}
        rejected = dict.fromkeys(seq_ids, 0)
        begin, commit = bm.begin_speculation, bm.commit_speculation

        def run() -> None:
            begin(drafts)
            commit(rejected)

        return Bench(run, NUM_SPECULATING_SEQS)

    return make


def make_swap(num_calls: int) -> Bench:
    """`swap_out` + `swap_in` of one 512-token (32-page) sequence."""
    bm = BlockManager(BlockManagerConfig(
        num_blocks=64, block_size=BLOCK, num_host_blocks=64, enable_prefix_cache=False,
    ))
    bm.allocate("a", tokens(PROMPT))
    swap_out, swap_in = bm.swap_out, bm.swap_in

    def run() -> None:
        swap_out("a")
        swap_in("a")

    return Bench(run, 1)


# -------------------------------------------------------------------- cases

CASES = [
    Case("a1", "a", "pool take(1) + release_all", "op", make_pool_get_free,
         20000, 2000, 1.0, "~1.4 us (1-block get+free)"),
    Case("a2", "a", "pool take_one() + release", "op", make_pool_take_one,
         20000, 2000),
    Case("a3", "a", "manager allocate(1 token) + free, no prefix cache", "op",
         make_manager_one_token(False), 5000, 500),
    Case("a4", "a", "manager allocate(1 token) + free, prefix cache on", "op",
         make_manager_one_token(True), 5000, 500),
    Case("b1", "b", "decode append(1 token), 256 seqs", "seq", make_decode(False),
         40, 4, 2.0, "4-8 us (allocate_slots)"),
    Case("b2", "b", "decode can_append + append, 256 seqs", "seq", make_decode(True),
         40, 4),
    Case("c1", "c", "512-token allocate + free, no prefix cache", "request",
         make_request_no_cache, 2000, 200, 20.0, "50-90 us"),
    Case("d1", "d", "512-token request, 496 hit: match + allocate + free", "request",
         make_request_prefix_hit, 2000, 100, 25.0, "44-72 us"),
    Case("d2", "d", "same 512-token request repeated (511 hit + CopyBlock)", "request",
         make_request_repeated, 2000, 200),
    *(
        Case(f"e{i}", "e", f"trie match {n // 1000}k tokens, {shape}", "1k tokens",
             make_trie_match(n, branch), calls, calls // 10)
        for i, (n, branch, shape, calls) in enumerate(
            [
                (1024, None, "one edge", 5000),
                (4096, None, "one edge", 2000),
                (16384, None, "one edge", 500),
                (1024, 256, "node every 256", 5000),
                (4096, 256, "node every 256", 2000),
                (16384, 256, "node every 256", 500),
            ],
            start=1,
        )
    ),
    Case("e7", "e", "trie match 16k tokens, one edge, query shares int objects", "1k tokens",
         make_trie_match(16384, None, same_objects=True), 500, 50),
    *(
        Case(f"g{i}", "g", f"{what}, GroupedStore {layout}", unit, make, calls, iterations)
        for i, (what, unit, make, calls, iterations, layout) in enumerate(
            [
                *(
                    ("d1", "request", partial(make_request_prefix_hit, layout=layout),
                     2000, 100, layout)
                    for layout in LAYOUTS
                ),
                *(
                    ("b1", "seq", make_decode(False, layout), 40, 4, layout)
                    for layout in ("full", "gemma3")
                ),
            ],
            start=1,
        )
    ),
    Case("f1", "f", "16-token new prompt alloc + free, room (no eviction)", "request",
         make_evict(16, full=False), 2000, 100),
    Case("f2", "f", "16-token new prompt alloc + free, evicts 1-page leaf", "request",
         make_evict(16, full=True), 2000, 100),
    Case("f3", "f", "512-token new prompt alloc + free, room (no eviction)", "request",
         make_evict(PROMPT, full=False), 1000, 50),
    Case("f4", "f", "512-token new prompt alloc + free, evicts 32-page leaf", "request",
         make_evict(PROMPT, full=True), 1000, 50),
    Case("s1", "s", "begin_speculation(4 drafts) + commit(0 kept), 64 seqs", "seq",
         make_speculation(False), 100, 10),
    Case("s2", "s", "s1, hybrid (checkpoint slot copy and restore)", "seq",
         make_speculation(True), 100, 10),
    Case("s3", "s", "swap_out + swap_in, 32-page sequence", "swap", make_swap, 1000, 100),
]


# -------------------------------------------------------------------- table


def time_case(case: Case, repeats: int, scale: float, clock=time.perf_counter) -> float:
    """Best us per unit over `repeats` fresh states of `calls` calls each,
    timed with `clock` (wall time by default)."""
    calls = max(1, int(case.calls * scale))
    best = float("inf")
    for _ in range(repeats):
        bench = case.make(calls)
        run = bench.run
        gc.collect()
        start = clock()
        for _ in range(calls):
            run()
        elapsed = clock() - start
        best = min(best, elapsed / calls / bench.units * 1e6)
        del bench, run
    return best


def format_row(case: Case, us: float) -> str:
    target = f"<= {case.target_us:g}" if case.target_us is not None else ""
    met = "" if case.target_us is None else ("yes" if us <= case.target_us else "NO")
    return (
        f"| {case.key} | {case.name} | {case.unit} | {us:.3f} | {target} | {met} "
        f"| {case.vllm} |"
    )


def linearity(results: dict[str, float]) -> list[str]:
    """Least-squares fit of match time = fixed + slope * k tokens (1k..16k)."""
    lines = []
    sizes = (1.024, 4.096, 16.384)
    for keys, shape in ((("e1", "e2", "e3"), "one edge"), (("e4", "e5", "e6"), "node every 256")):
        if not all(k in results for k in keys):
            continue
        times = [results[k] * size for k, size in zip(keys, sizes)]
        slope, fixed = fit_line(sizes, times)
        worst = max(abs(fixed + slope * x - y) / y for x, y in zip(sizes, times))
        lines.append(
            f"trie match, {shape}: {slope:.2f} us per 1k tokens + {fixed:.2f} us fixed "
            f"(worst residual {worst:.0%})"
        )
    return lines


#: Grouped-store cases and the plain-manager case each one is the peer of
#: (g1-g3 run d1's request, g4-g5 b1's decode step).
GROUPED_PEERS = {"g1": "d1", "g2": "d1", "g3": "d1", "g4": "b1", "g5": "b1"}


def grouped_ratios(results: dict[str, float]) -> list[str]:
    """Each grouped case's time over its plain-manager peer's, same run."""
    return [
        f"{key} / {peer} = {results[key] / results[peer]:.2f}x"
        for key, peer in GROUPED_PEERS.items()
        if key in results and peer in results
    ]


def fit_line(xs, ys) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="fresh states per case")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply calls per repeat")
    parser.add_argument("--only", default="", help="comma-separated case keys")
    parser.add_argument(
        "--interleave", action="store_true",
        help="time the cases round-robin, one repeat each per round (load drift "
        "hits every case alike: fairer ratios on a shared machine)",
    )
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="time.process_time (this process's CPU time) instead of wall time: "
        "other jobs on a shared machine count less",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    wanted = {key for key in args.only.split(",") if key}
    cases = [case for case in CASES if not wanted or case.key in wanted]
    print(f"python {platform.python_version()}, {platform.machine()}, "
          f"best of {args.repeats} repeats{' interleaved' if args.interleave else ''}, "
          f"{clock.__qualname__}")
    print("| case | what | unit | us/unit | target | met? | vLLM 0.33 (issues) |")
    print("|---|---|---|---|---|---|---|")
    results: dict[str, float] = {}
    if args.interleave:
        for _ in range(args.repeats):
            for case in cases:
                us = time_case(case, 1, args.scale, clock)
                results[case.key] = min(results.get(case.key, us), us)
        for case in cases:
            print(format_row(case, results[case.key]))
    else:
        for case in cases:
            results[case.key] = time_case(case, args.repeats, args.scale, clock)
            print(format_row(case, results[case.key]), flush=True)
    for line in linearity(results) + grouped_ratios(results):
        print(line)


if __name__ == "__main__":
    main()
