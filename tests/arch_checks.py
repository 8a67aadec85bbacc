"""The checks the architecture sweep runs on one model, each against mlx-lm.

Every reference is the same model on mlx-lm's own `make_prompt_cache`
caches, one sequence at a time, full prompt in one forward; the paged run
uses `PagedCache.for_model` views (or the `Engine`). A check raises
`AssertionError` naming the first position that differs by more than `TOL`.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from cache import PagedCache
from scheduler import Engine, SamplingParams
from scheduler.engine.batch_probe import BatchSupport
from tests.arch_models import VOCAB

TOL = 1e-4
BLOCK = 8
PREFIX = 42  # shared prefix of the reuse check: not a multiple of BLOCK


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def reference(model, seq: list[int], prefill: list[int]) -> np.ndarray:
    """Logits at every position of `seq` on mlx-lm's caches, fed as the paged
    run feeds it: chunks of the `prefill` sizes, then one token per forward
    (some models, e.g. plamo3, give different logits for the same tokens
    when the chunking differs, even on mlx-lm's own caches)."""
    cache = make_prompt_cache(model)
    sizes = list(prefill) + [1] * (len(seq) - sum(prefill))
    out, i = [], 0
    for n in sizes:
        out.append(np.array(model(mx.array([seq[i : i + n]]), cache=cache)[0].astype(mx.float32)))
        i += n
    return np.concatenate(out)


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    diff = np.abs(np.asarray(got, dtype=np.float64) - want)
    assert np.all(np.isfinite(got)), f"{what}: non-finite logits"
    worst = float(diff.max())
    assert worst <= TOL, (f"{what}: max |diff| {worst:.3g} "
                          f"at {np.unravel_index(diff.argmax(), diff.shape)}")


def paged(model) -> PagedCache:
    return PagedCache.for_model(model, num_blocks=96, block_size=BLOCK, num_slots=8)


def forward(model, pc: PagedCache, ids: list[str], rows: list[list[int]], num_new=None):
    """One forward of right-padded `rows` for `ids`; logits as numpy."""
    width = max(map(len, rows))
    padded = [r + [0] * (width - len(r)) for r in rows]
    views = pc.views(ids, num_new=num_new)
    return np.array(model(mx.array(padded), cache=views).astype(mx.float32))


def decode_alone(model, pc: PagedCache, seq_id: str, toks: list[int]) -> np.ndarray:
    out = []
    for t in toks:
        pc.append(seq_id, [t])
        out.append(forward(model, pc, [seq_id], [[t]])[0])
    return np.concatenate(out)


def check_single(model) -> None:
    """One prompt prefilled in one forward, then three decode steps."""
    prompt, steps = tokens(1, 21), tokens(2, 3)
    want = reference(model, prompt + steps, [len(prompt)])
    pc = paged(model)
    pc.allocate("a", prompt)
    close(forward(model, pc, ["a"], [prompt])[0], want[: len(prompt)], "prefill")
    close(decode_alone(model, pc, "a", steps), want[len(prompt):], "decode")
    pc.check_integrity()


def check_batched_decode(model) -> None:
    """Two sequences of different lengths, prefilled alone, decoded together."""
    prompts, steps = [tokens(3, 13), tokens(4, 21)], [tokens(5, 3), tokens(6, 3)]
    ids = ["a", "b"]
    pc = paged(model)
    for sid, p in zip(ids, prompts):
        pc.allocate(sid, p)
        forward(model, pc, [sid], [p])
    got = []
    for k in range(3):
        for sid, s in zip(ids, steps):
            pc.append(sid, [s[k]])
        got.append(forward(model, pc, ids, [[s[k]] for s in steps])[:, 0])
    got = np.stack(got, axis=1)
    for b, (p, s) in enumerate(zip(prompts, steps)):
        close(got[b], reference(model, p + s, [len(p)])[len(p):], f"row {b} decode")
    pc.check_integrity()


def check_ragged_prefill(model) -> None:
    """Two prompts of different lengths in one right-padded forward, then one
    batched decode step."""
    prompts, nxt = [tokens(7, 9), tokens(8, 17)], tokens(9, 2)
    ids = ["a", "b"]
    pc = paged(model)
    for sid, p in zip(ids, prompts):
        pc.allocate(sid, p)
    logits = forward(model, pc, ids, prompts, num_new=[len(p) for p in prompts])
    for sid, t in zip(ids, nxt):
        pc.append(sid, [t])
    step = forward(model, pc, ids, [[t] for t in nxt])[:, 0]
    for b, (p, t) in enumerate(zip(prompts, nxt)):
        want = reference(model, p + [t], [len(p)])
        close(logits[b, : len(p)], want[: len(p)], f"row {b} prefill")
        close(step[b], want[len(p)], f"row {b} decode")
    pc.check_integrity()


def check_prefix_reuse(model) -> None:
    """A 42-token prefix (not page-aligned) of a finished sequence (prefilled
    in two chunks, then decoded) is reused by the next one; its suffix and
    decode match a run without reuse. Recurrent state exists only where a
    snapshot was taken, and a sliding window keeps only the pages before a
    cached end, so those models checkpoint after the first chunk
    (`cache_prefix`, what the scheduler does at a branch point); models of
    full attention alone rely on `free`."""
    prefix = tokens(10, PREFIX)
    first, second, steps = prefix + tokens(11, 6), prefix + tokens(12, 9), tokens(13, 2)
    pc = paged(model)
    pc.allocate("a", first)
    forward(model, pc, ["a"], [prefix], num_new=[PREFIX])
    if pc.recurrent is not None or pc.store.windows != (None,):
        pc.cache_prefix("a")
    forward(model, pc, ["a"], [first[PREFIX:]], num_new=[len(first) - PREFIX])
    decode_alone(model, pc, "a", tokens(17, 3))
    pc.free("a")
    alloc = pc.allocate("b", second)
    assert alloc.num_cached_tokens == PREFIX, f"reused {alloc.num_cached_tokens} of {PREFIX}"
    want = reference(model, second + steps, [PREFIX, len(second) - PREFIX])
    close(forward(model, pc, ["b"], [second[PREFIX:]])[0], want[PREFIX : len(second)], "suffix")
    close(decode_alone(model, pc, "b", steps), want[len(second):], "decode")
    pc.check_integrity()


def check_engine(model) -> BatchSupport:
    """`Engine.generate` (greedy, 3 prompts batched) equals mlx-lm's
    `generate_step` on each prompt alone. Returns what the engine batched."""
    prompts, max_tokens = [tokens(14, 5), tokens(15, 11), tokens(16, 19)], 4
    engine = Engine(model, num_blocks=64, block_size=BLOCK, prefill_batch=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    for p, out in zip(prompts, outs):
        want = [int(t) for t, _ in zip(
            (tok for tok, _ in generate_step(mx.array(p), model, max_tokens=max_tokens,
                                             prompt_cache=make_prompt_cache(model))),
            range(max_tokens))]
        assert out.tokens == want, f"prompt of {len(p)}: engine {out.tokens} vs mlx-lm {want}"
    engine.check_integrity()
    return engine.batching


CHECKS: dict[str, Callable[[object], None]] = {
    "single": check_single,
    "batched_decode": check_batched_decode,
    "ragged_prefill": check_ragged_prefill,
    "prefix_reuse": check_prefix_reuse,
    "engine": check_engine,
}
