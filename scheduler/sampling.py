"""Token sampling for a batch of rows with per-request parameters.

Greedy rows (temperature 0, or below `GREEDY_BELOW`, where 1 / T would
overflow float32) take the argmax (as mlx-lm's `greedy_sampler`); the others
sample from softmax(logits / temperature) after mlx-lm's `apply_top_p`.
Rows that share (temperature, top_p) and no seed are sampled in one call;
a seeded request draws from its own key chain, so its tokens do not depend
on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from scheduler.request import SamplingParams


class KeyChain:
    """A per-request random key stream: `next()` gives a fresh subkey."""

    __slots__ = ("_key",)

    def __init__(self, seed: int) -> None:
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def sample_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    keys: Sequence[KeyChain | None],
) -> mx.array:
    """One token per row of `logits` ``[R, V]`` (lazy int32 ``[R]``).

    `params[r]` and `keys[r]` (None: the global generator) belong to row r.
    Cost: one argmax for all greedy rows, one log-softmax (+ sort for
    top-p) and one categorical draw per group of rows with equal parameters.
    """
    rows = len(params)
    if rows != logits.shape[0] or rows != len(keys):
        raise ValueError(f"{logits.shape[0]} logit rows for {rows} params / {len(keys)} keys")
    if all(p.greedy for p in params):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    groups: dict[tuple, list[int]] = {}
    for r, (p, k) in enumerate(zip(params, keys)):
        if p.greedy:
            group = ("greedy",)
        else:  # seeded rows draw alone, from their own key
            group = (p.temperature, p.top_p, -1 if k is None else r)
        groups.setdefault(group, []).append(r)
    parts, order = [], []
    for group, members in groups.items():
        sub = logits[mx.array(members)] if len(members) < rows else logits
        if group[0] == "greedy":
            tokens = mx.argmax(sub, axis=-1)
        else:
            p = params[members[0]]
            key = keys[members[0]]
            tokens = _categorical(sub, p.temperature, p.top_p, key.next() if key else None)
        parts.append(tokens.astype(mx.int32))
        order.extend(members)
    tokens = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    if order != list(range(rows)):
        inverse = [0] * rows
        for pos, r in enumerate(order):
            inverse[r] = pos
        tokens = tokens[mx.array(inverse)]
    return tokens


def _categorical(logits: mx.array, temperature: float, top_p: float, key) -> mx.array:
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    return mx.random.categorical(logprobs * (1.0 / temperature), key=key)
