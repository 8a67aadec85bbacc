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
from scheduler.engine.kv_events import KVEventPublisher


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


def engine_run(model, prompts, with_events: bool) -> tuple[float, float, int]:
    """(wall seconds, seconds inside publish, batches) of one greedy run."""
    from scheduler import Engine, SamplingParams

    engine = Engine(model, num_blocks=1024, block_size=16, max_num_seqs=8,
                    kv_events=NullSink() if with_events else None)
    inside = [0.0]
    if with_events:
        publish = engine.kv_events.publish

        def timed_publish():
            t = time.perf_counter()
            try:
                return publish()
            finally:
                inside[0] += time.perf_counter() - t

        engine.kv_events.publish = timed_publish
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    wall = time.perf_counter() - t0
    return wall, inside[0], engine.kv_events.num_batches if with_events else 0


def engine_table(rounds: int = 3) -> None:
    """The engine with and without events, alternated in one run."""
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=4,
                           intermediate_size=1408, num_attention_heads=8,
                           num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=32000)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    rng = random.Random(1)
    system = [rng.randrange(32000) for _ in range(512)]
    prompts = [system + [rng.randrange(32000) for _ in range(64)] for _ in range(48)]
    walls = {False: [], True: []}
    inside, batches = [], 0
    for _ in range(rounds):
        for with_events in (False, True):
            wall, spent, batches = engine_run(model, prompts, with_events)
            walls[with_events].append(wall)
            if with_events:
                inside.append(spent)
    off, on = statistics.median(walls[False]), statistics.median(walls[True])
    print()
    print("| engine run (48 requests, 512-token shared prefix) | wall | publish time "
          "| batches |")
    print("|---|---|---|---|")
    print(f"| without events | {off:.2f} s | | |")
    print(f"| with events (null sink) | {on:.2f} s | {statistics.median(inside) * 1e3:.1f} ms "
          f"| {batches} |")
    print(f"| ratio with / without | {on / off:.3f} | | |")


def main() -> None:
    print("| pages (16 tokens) | conversations | advertised blocks | allocate+free "
          "| publish (changed) | ratio | publish (unchanged) |")
    print("|---|---|---|---|---|---|---|")
    for num_blocks, num_conversations in ((1024, 16), (4096, 64), (16384, 256)):
        life, pub, same, num_adv = measure(num_blocks, num_conversations)
        print(f"| {num_blocks} | {num_conversations} | {num_adv:.0f} | {life * 1e3:.2f} ms "
              f"| {pub * 1e3:.2f} ms | {pub / life:.0f}x | {same * 1e6:.1f} us |")
    engine_table()


if __name__ == "__main__":
    main()
