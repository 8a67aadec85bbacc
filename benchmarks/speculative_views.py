"""mlx-lm's own `speculative_generate_step` on paged views (`PagedCache.speculative_model`).

Run:
    python benchmarks/speculative_views.py counts
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/speculative_views.py timed [--layers 8] [--tokens 32] [--rounds 2]

`counts`: the recurrent rollback's cost, counted (no timing: the counts do
not depend on the machine). The test-sized lfm2, qwen3_next and
recurrent_gemma (tests/tiny_models.py) with drafts that are noisy copies of
the target (more noise: less agreement), k = 3, 8 prompts of 2..69 tokens
run one at a time, 32 new tokens each, greedy: acceptance, and the
positions the target and the draft compute again after a trim restored
their checkpoints (replayed in front of the next call's input), per
generated token.

`timed`: generated tokens/s at batch 1 of the same loop on mlx-lm's own
caches and on paged views (prefill included), and of mlx-lm's
`generate_step` without a draft, side by side in alternating rounds
(median). Target and drafts as in `compare_speculative.py`: random-weight
qwen3 with Qwen3-0.6B's layer sizes, `--layers` of them, drafts of hidden
256 x 2 layers whose agreement `--noise` sets; `--model lfm2` for the hybrid
(mlx-lm's own caches refuse it: views only). float32.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, speculative_generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare_speculative

from compare_speculative import VOCAB, draft_model, prompts, target_model  # noqa: E402

from cache import PagedCache  # noqa: E402
from tests.scheduler.test_engine import make_prompts  # noqa: E402
from tests.scheduler.test_speculative import noisy_copy  # noqa: E402
from tests.tiny_models import HYBRID_VOCAB, built  # noqa: E402

K = 3


class ReplayCounter:
    """A `SpeculativeModel` whose calls count the positions they replay."""

    def __init__(self, spec, storage: PagedCache) -> None:
        self.spec, self.storage, self.replayed = spec, storage, 0
        self.layers = spec.layers

    def __call__(self, x, cache=None):
        self.replayed += sum(self.storage.num_replay(s) for s in self.spec.seq_ids)
        return self.spec(x, cache=cache)


def on_views(target, draft, prompt: list[int], max_tokens: int, num_blocks: int = 64,
             block_size: int = 8, count: bool = False):
    """(tokens, accepted drafts, target replayed, draft replayed) of one run on paged views."""
    pc = PagedCache.for_model(target, num_blocks=num_blocks, block_size=block_size, num_slots=4)
    dc = PagedCache.for_model(draft, num_blocks=num_blocks, block_size=block_size, num_slots=4)
    pc.allocate("a", prompt)
    dc.allocate("a", prompt)
    t, d = pc.speculative_model(target, ["a"]), dc.speculative_model(draft, ["a"])
    cache = t.cache + d.cache
    if count:
        t, d = ReplayCounter(t, pc), ReplayCounter(d, dc)
    steps = speculative_generate_step(mx.array(prompt), t, d, num_draft_tokens=K,
                                      max_tokens=max_tokens, prompt_cache=cache)
    flags = [bool(f) for _, _, f in steps]
    for storage in (pc, dc):
        storage.check_integrity()
        storage.free("a")
    if count:
        return flags, t.replayed, d.replayed
    return flags


def acceptance(flags: list[bool]) -> float:
    """Accepted drafts per proposed one (each round yields one target token)."""
    accepted = sum(flags)
    return accepted / max(1, len(flags) - accepted) / K


def counts() -> None:
    print("| model | draft noise | acceptance | generated | target replayed / token "
          "| draft replayed / token |")
    print("|---|---|---|---|---|---|")
    work = make_prompts(HYBRID_VOCAB)[:8]
    for name in ("lfm2", "qwen3_next", "recurrent_gemma"):
        for noise in (0.005, 0.05, 0.2, 3.0):
            draft = noisy_copy(name, noise)
            flags, target_replayed, draft_replayed = [], 0, 0
            for prompt in work:
                f, t, d = on_views(built(name), draft, prompt, 32, num_blocks=96, count=True)
                flags += f
                target_replayed += t
                draft_replayed += d
            n = len(flags)
            print(f"| {name} | {noise} | {acceptance(flags):.2f} | {n} | "
                  f"{target_replayed / n:.2f} | {draft_replayed / n:.2f} |")


def timed(args) -> None:
    target = target_model(args.model, args.layers)
    drafts = {noise: draft_model(args.model, target, noise) for noise in args.noise}
    prompt = prompts(VOCAB[args.model], 1, args.prompt_len, seed=1)[0]
    configs = [("generate_step", None)]
    if args.model == "qwen3":  # mlx-lm's caches refuse a recurrent model
        configs += [("mlx-lm caches", n) for n in args.noise]
    configs += [("paged views", n) for n in args.noise]
    results: dict = {c: [] for c in configs}
    rates: dict = {}
    for _ in range(args.rounds):
        for config in configs:
            runner, noise = config
            t0 = time.perf_counter()
            if runner == "generate_step":
                n = len([t for t, _ in generate_step(mx.array(prompt), target,
                                                      max_tokens=args.tokens)])
            elif runner == "mlx-lm caches":
                flags = [bool(f) for _, _, f in speculative_generate_step(
                    mx.array(prompt), target, drafts[noise], num_draft_tokens=K,
                    max_tokens=args.tokens)]
                n, rates[config] = len(flags), acceptance(flags)
            else:
                flags = on_views(target, drafts[noise], prompt, args.tokens, num_blocks=64,
                                 block_size=16)
                n, rates[config] = len(flags), acceptance(flags)
            results[config].append(n / (time.perf_counter() - t0))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__}, "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '-')}")
    print(f"target: {args.model} (hidden 1024) x {args.layers} layers; draft: hidden 256 x 2 "
          f"layers; k={K}, prompt {args.prompt_len}, {args.tokens} new tokens, "
          f"median of {args.rounds} rounds")
    base = float(np.median(results[("generate_step", None)]))
    print("| runner | draft noise | tok/s | vs generate_step | acceptance |")
    print("|---|---|---|---|---|")
    for config in configs:
        runner, noise = config
        tps = float(np.median(results[config]))
        rate = rates.get(config)
        print(f"| {runner} | {'-' if noise is None else noise} | {tps:.2f} | "
              f"{tps / base:.2f}x | {'-' if rate is None else f'{rate:.2f}'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["counts", "timed"])
    parser.add_argument("--model", choices=sorted(VOCAB), default="qwen3")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 3.0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.part == "counts":
        counts()
    else:
        timed(args)


if __name__ == "__main__":
    main()
