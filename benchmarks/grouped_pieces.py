"""Where a grouped request's time goes: case d1's request, piece by piece.

Run: python benchmarks/grouped_pieces.py [--layout gemma3] [--rounds 7]

Case d1 of `blockmgr_table.py` (a 512-token request with a 496-token hit)
on a `GroupedStore` costs the prompt check and packing once, then each
group's `find_prefix`, `can_allocate`, `allocate` and `free`. This prints
the CPU time (`time.process_time`, best of `--rounds` fresh states) of:

* the shared check and packing of the prompt (`validation.packed_prompt`);
* each group's `find_prefix` and `can_allocate` (pure: repeated on one state);
* each group's find + allocate + free, the group driven alone (on a store
  of its own, so the other groups' drifting apart does not matter), and
  its allocate and its free apart (all allocated, then all freed: as many
  sequences locking the cached prefix as calls);
* the whole request on the store, and on a plain `BlockManager` (d1).

The whole request minus the pieces is the store's own overhead.
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


def group_alone(layout: str, group: int, packed_queries):
    """find + allocate + free of every query in one group of a fresh store."""
    m = warm_store(layout).managers[group]

    def run() -> None:
        for query, packed in packed_queries:
            match = m.find_prefix(query, None, len(query) - 1, packed=packed)
            m.allocate("r", query, None, match=match, packed=packed)
            m.free("r")

    return run


def group_phases(layout: str, group: int, packed_queries) -> tuple[float, float]:
    """CPU us per `allocate` (given its match) and per `free` in one group of
    a fresh store: all queries allocated in a row (each with its own id),
    then all freed."""
    m = warm_store(layout).managers[group]
    # Found up front: allocating leaves the cached path as it is (a match
    # becomes its sequence's page table, so each needs its own).
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


def measure(layout: str) -> dict[str, float]:
    times: dict[str, float] = {}
    queries = prompts()
    query, packed = packed_prompt(queries[0], "tokens")
    store = warm_store(layout)
    times["check + pack the prompt (once)"] = cpu_us(
        repeat(packed_prompt, queries[1], "tokens"), NUM_CALLS
    )
    for g, m in enumerate(store.managers):
        match = m.find_prefix(query, None, PREFIX_HIT, packed=packed)
        times[f"group {g}: find_prefix"] = cpu_us(
            repeat(m.find_prefix, query, None, PREFIX_HIT, packed=packed), NUM_CALLS)
        times[f"group {g}: can_allocate"] = cpu_us(
            repeat(m.can_allocate, query, None, match=match, packed=packed), NUM_CALLS)
    for g in range(len(store.managers)):
        packed_queries = [packed_prompt(q, "tokens") for q in queries]
        times[f"group {g}: find + allocate + free"] = cpu_us(
            group_alone(layout, g, packed_queries), NUM_CALLS)
        allocate_us, free_us = group_phases(
            layout, g, [packed_prompt(q, "tokens") for q in queries])
        times[f"group {g}: allocate (given its match)"] = allocate_us
        times[f"group {g}: free"] = free_us
    for key, store in (("GroupedStore", warm_store(layout)), ("BlockManager (d1)", warm_store(None))):
        fresh_queries = prompts()
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
    for key, us in best.items():
        print(f"| {key} | {us:.2f} |")
    num_groups = len(LAYOUTS[args.layout])
    # What the store's allocate + free calls: the packing, every group's
    # find + allocate + free, and can_allocate of groups 1.. (group 0's
    # allocate checks itself).
    pieces = best["check + pack the prompt (once)"] + sum(
        best[f"group {g}: find + allocate + free"] for g in range(num_groups)
    ) + sum(best[f"group {g}: can_allocate"] for g in range(1, num_groups))
    whole = best["whole request, GroupedStore"]
    print(f"store overhead (whole - pieces): {whole - pieces:.2f} us; "
          f"store / d1: {whole / best['whole request, BlockManager (d1)']:.2f}x")


if __name__ == "__main__":
    main()
