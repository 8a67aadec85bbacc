"""Cost of KV events: one `KVEventPublisher.publish()` per engine step.

A bookkeeping-only `BlockManager` filled like a busy server (a shared
system prompt, many multi-turn conversations, the pool full so evictions
run), then, side by side in one run: the bookkeeping of one request that a
step already does (`allocate` + `free` of a new turn) and the publish that
follows it (servable blocks of the whole cache, the diff, msgpack encoding;
the sink drops the bytes), and a publish after a step that changed no hit.
Run:
`python benchmarks/bench_kv_events.py` (prints a table; see BENCHMARKS.md).
"""

from __future__ import annotations

import random
import statistics
import time

from blockmgr import BlockManager, BlockManagerConfig
from scheduler.kv_events import KVEventPublisher


class NullSink:
    def __init__(self):
        self.num_bytes = 0

    def send(self, payload: bytes) -> None:
        self.num_bytes += len(payload)

    def close(self) -> None:
        pass


def filled_manager(num_blocks: int, block_size: int, num_conversations: int, seed: int = 0):
    rng = random.Random(seed)
    bm = BlockManager(BlockManagerConfig(num_blocks=num_blocks, block_size=block_size))
    system = [rng.randrange(32000) for _ in range(1024)]
    histories = [list(system) for _ in range(num_conversations)]
    for turn in range(3):
        for i, history in enumerate(histories):
            history += [rng.randrange(32000) for _ in range(rng.randrange(64, 256))]
            bm.allocate((turn, i), history)
            bm.free((turn, i))
    return bm, histories, rng


def measure(num_blocks: int, num_conversations: int, rounds: int = 30, block_size: int = 16):
    bm, histories, rng = filled_manager(num_blocks, block_size, num_conversations)
    publisher = KVEventPublisher(bm, NullSink())
    publisher.publish()  # the first batch advertises everything
    lifecycle, publish, unchanged, num_blocks_advertised = [], [], [], []
    for r in range(rounds):
        history = histories[r % len(histories)]
        history += [rng.randrange(32000) for _ in range(128)]
        t0 = time.perf_counter()
        bm.allocate(("bench", r), history)
        bm.free(("bench", r))
        t1 = time.perf_counter()
        publisher.publish()
        t2 = time.perf_counter()
        publisher.publish()  # a step that changed no hit: the version says so
        t3 = time.perf_counter()
        lifecycle.append(t1 - t0)
        publish.append(t2 - t1)
        unchanged.append(t3 - t2)
        num_blocks_advertised.append(len(publisher.advertised))
    assert publisher.num_errors == 0
    return (statistics.median(lifecycle), statistics.median(publish),
            statistics.median(unchanged), statistics.median(num_blocks_advertised))


def main() -> None:
    print("| pages (16 tokens) | conversations | advertised blocks | allocate+free "
          "| publish (changed) | ratio | publish (unchanged) |")
    print("|---|---|---|---|---|---|---|")
    for num_blocks, num_conversations in ((1024, 16), (4096, 64), (16384, 256)):
        life, pub, same, num_adv = measure(num_blocks, num_conversations)
        print(f"| {num_blocks} | {num_conversations} | {num_adv:.0f} | {life * 1e3:.2f} ms "
              f"| {pub * 1e3:.2f} ms | {pub / life:.0f}x | {same * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
