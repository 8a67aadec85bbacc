"""Where a grouped request's time goes: case d1's request, piece by piece.

Run: python benchmarks/grouped_pieces.py [--layout gemma3] [--rounds 7]

Case d1 of `blockmgr_table.py` (a 512-token request with a 496-token hit)
on a `GroupedStore`, whose group-0 `BlockManager` keeps every group (one
trie walk, lock, record and insert; further page groups add their page
takes, references and window checks), next to a plain `BlockManager` (d1).
This prints the CPU time (`time.process_time`, best of `--rounds` fresh
states) of, for both:

* `find_prefix` (the walk, the window checks, the match's page lists) and
  `can_allocate` given that match (pure: repeated on one state);
* `allocate` given its match and `free`, apart (all allocated, then all
  freed: as many sequences locking the cached prefix as calls);
* the whole request (`allocate` + `free`, one request at a time);

and the shared check and packing of the prompt. The store's column minus
the plain one is what the further groups add to each piece.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from blockmgr_table import LAYOUTS, PREFIX_HIT, PROMPT, manager, pages_for, tokens, unique_prompts

from blockmgr import BlockManager
from blockmgr.validation import packed_prompt

NUM_CALLS = 2000


def warm_store(layout: str | None):
    """A store (or plain manager) with the 496-token prefix cached, as d1's."""
    store = manager(pages_for(PROMPT) + NUM_CALLS + 16, layout=layout)
    store.allocate("warm", tokens(PREFIX_HIT) + [0])
    store.free("warm", num_computed=PREFIX_HIT)
    return store


def prompts() -> list[list[int]]:
    """d1's prompts: the cached prefix and a new 16-token tail each."""
    return [tokens(PREFIX_HIT) + tail for tail in unique_prompts(NUM_CALLS, PROMPT - PREFIX_HIT)]


def repeat(call, *args, **kwargs):
    """A run of `NUM_CALLS` calls of `call(*args, **kwargs)`, results dropped."""

    def run() -> None:
        for _ in range(NUM_CALLS):
            call(*args, **kwargs)

    return run


def cpu_us(run, num_calls: int) -> float:
    gc.collect()
    start = time.process_time()
    run()
    return (time.process_time() - start) / num_calls * 1e6


def lifecycle(store, queries) -> None:
    allocate, free = store.allocate, store.free
    for query in queries:
        allocate("r", query)
        free("r")


def group_zero(store) -> BlockManager:
    """The manager keeping every group (the plain manager itself)."""
    return store if isinstance(store, BlockManager) else store.managers[0]


def phases(store, packed_queries) -> tuple[float, float]:
    """CPU us per `allocate` (given its match) and per `free` on `store`'s
    group-0 manager: all queries allocated in a row (each with its own id),
    then all freed."""
    m = group_zero(store)
    # Found up front: allocating leaves the cached path as it is (a match
    # becomes its sequence's page tables, so each needs its own).
    matches = [
        m.find_prefix(query, None, len(query) - 1, packed=packed)
        for query, packed in packed_queries
    ]

    def allocate_all() -> None:
        for index, ((query, packed), match) in enumerate(zip(packed_queries, matches)):
            m.allocate(index, query, None, match=match, packed=packed)

    def free_all() -> None:
        for index in range(len(packed_queries)):
            m.free(index)

    return cpu_us(allocate_all, NUM_CALLS), cpu_us(free_all, NUM_CALLS)


#: The two stores compared: the layout's `GroupedStore` and d1's plain manager.
STORES = ("GroupedStore", "BlockManager (d1)")


def measure(layout: str) -> dict[str, float]:
    times: dict[str, float] = {}
    queries = prompts()
    query, packed = packed_prompt(queries[0], "tokens")
    times["check + pack the prompt (once, shared)"] = cpu_us(
        repeat(packed_prompt, queries[1], "tokens"), NUM_CALLS
    )
    for key, store_layout in zip(STORES, (layout, None)):
        m = group_zero(warm_store(store_layout))
        match = m.find_prefix(query, None, PREFIX_HIT, packed=packed)
        times[f"find_prefix, {key}"] = cpu_us(
            repeat(m.find_prefix, query, None, PREFIX_HIT, packed=packed), NUM_CALLS)
        times[f"can_allocate, {key}"] = cpu_us(
            repeat(m.can_allocate, query, None, match=match, packed=packed), NUM_CALLS)
        allocate_us, free_us = phases(
            warm_store(store_layout), [packed_prompt(q, "tokens") for q in queries])
        times[f"allocate (given its match), {key}"] = allocate_us
        times[f"free, {key}"] = free_us
        fresh_queries = prompts()
        store = warm_store(store_layout)
        times[f"whole request, {key}"] = cpu_us(
            lambda: lifecycle(store, fresh_queries), NUM_CALLS)  # noqa: B023 (run at once)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="gemma3", choices=sorted(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=7, help="fresh states per piece")
    args = parser.parse_args()
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for key, us in measure(args.layout).items():
            best[key] = min(best.get(key, us), us)
    print(f"layout {args.layout} {LAYOUTS[args.layout]}, CPU us per request, "
          f"best of {args.rounds}")
    print("| piece | GroupedStore | BlockManager (d1) | difference |")
    print("|---|---|---|---|")
    print(f"| check + pack the prompt (once, shared) | "
          f"{best['check + pack the prompt (once, shared)']:.2f} | | |")
    for piece in ("find_prefix", "can_allocate", "allocate (given its match)", "free",
                  "whole request"):
        grouped, plain = (best[f"{piece}, {key}"] for key in STORES)
        print(f"| {piece} | {grouped:.2f} | {plain:.2f} | {grouped - plain:+.2f} |")
    grouped, plain = (best[f"whole request, {key}"] for key in STORES)
    print(f"whole request, store / d1: {grouped / plain:.2f}x")


if __name__ == "__main__":
    main()
