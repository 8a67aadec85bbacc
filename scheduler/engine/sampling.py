"""Token sampling for a batch of rows with per-request parameters.

One `sample_rows` call per step samples every row of the step:

1. user logits processors (mlx-lm's signature, one row at a time: they are
   arbitrary code), then logit bias, then penalties (`adjust_logits`): only
   the (row, token) entries that have a bias or occur in the row's history
   are touched, with one gather and one scatter for all rows; then the
   grammar masks of constrained rows (`mask_logits`: one scatter over those
   rows only, nothing when no row has one);
2. greedy rows (temperature 0, or below `GREEDY_BELOW`, where 1 / T would
   overflow float32) take the argmax (as mlx-lm's `greedy_sampler`);
3. the others: log-softmax, then mlx-lm's `apply_top_p`, `apply_min_p`,
   `apply_top_k` (its `make_sampler` order), then a categorical draw from
   softmax(logprobs / temperature). Rows that share (temperature, top_p,
   min_p, top_k) and no seed are filtered and drawn in one call; a seeded
   request draws from its own key chain, so its tokens do not depend on what
   else is in the batch.

Penalties follow OpenAI / vLLM rather than mlx-lm's processors (which look
at the last 20 tokens of prompt and output, one row at a time): presence
and frequency count the sample's output tokens, repetition the prompt's and
the output's. `token_logprobs` gives the chosen token's log-probability and
the top N (log_softmax of the model's own logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from blockmgr.errors import InvalidArgument
from scheduler.core.constraints import unpack_masks
from scheduler.core.request import SamplingParams, TokenLogprob

#: (prompt tokens, output tokens so far) of a row; needed for penalties.
History = tuple[Sequence[int], Sequence[int]]


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
    histories: Sequence[History | None] | None = None,
    masks: Sequence[np.ndarray | None] | None = None,
) -> mx.array:
    """One token per row of `logits` ``[R, V]`` (lazy int32 ``[R]``).

    `params[r]`, `keys[r]` (None: the global generator), `histories[r]`
    (needed when the row has penalties) and `masks[r]` (the int32 bitmask of
    the tokens row r's grammar allows, None: every token) belong to row r.
    Cost: one gather/scatter over the biased and penalized entries, one
    argmax for all greedy rows, one log-softmax (+ sorts for the filters)
    and one categorical draw per group of rows with equal parameters.
    """
    rows = len(params)
    if rows != logits.shape[0] or rows != len(keys):
        raise InvalidArgument(f"{logits.shape[0]} logit rows for {rows} params / {len(keys)} keys")
    logits = adjust_logits(logits, params, histories)
    if masks is not None:
        logits = mask_logits(logits, masks)
    if all(p.greedy for p in params):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    groups: dict[tuple, list[int]] = {}
    for r, (p, k) in enumerate(zip(params, keys)):
        if p.greedy:
            group = ("greedy",)
        else:  # seeded rows draw alone, from their own key
            group = (*p.filter_key, -1 if k is None else r)
        groups.setdefault(group, []).append(r)
    parts, order = [], []
    for group, members in groups.items():
        sub = logits[mx.array(members)] if len(members) < rows else logits
        if group[0] == "greedy":
            tokens = mx.argmax(sub, axis=-1)
        else:
            key = keys[members[0]]
            logprobs = filtered_logprobs(sub, params[members[0]])
            scaled = logprobs * (1.0 / params[members[0]].temperature)
            tokens = mx.random.categorical(scaled, key=key.next() if key else None)
        parts.append(tokens.astype(mx.int32))
        order.extend(members)
    tokens = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    if order != list(range(rows)):
        inverse = [0] * rows
        for pos, r in enumerate(order):
            inverse[r] = pos
        tokens = tokens[mx.array(inverse)]
    return tokens


def mask_logits(logits: mx.array, masks: Sequence[np.ndarray | None]) -> mx.array:
    """`logits` ``[R, V]`` with -inf where row r's bitmask `masks[r]` has no
    bit (rows whose mask is None unchanged). O(constrained rows x V): one
    unpack and one scatter-add over those rows; `logits` itself is not
    changed (the logprobs are the model's)."""
    present = [(r, m) for r, m in enumerate(masks) if m is not None]
    if not present:
        return logits
    rows = [r for r, _ in present]
    allowed = unpack_masks([m for _, m in present], logits.shape[-1])
    penalty = np.where(allowed, np.float32(0.0), np.float32(-np.inf))
    return logits.astype(mx.float32).at[mx.array(rows)].add(mx.array(penalty))


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """log_softmax of `logits` ``[R, V]`` with mlx-lm's top-p, min-p and
    top-k filters applied (filtered tokens at -inf); temperature not applied."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k is not None and params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def adjust_logits(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[History | None] | None,
) -> mx.array:
    """Logits ``[R, V]`` after each row's logits processors, logit bias,
    then penalties (see the module doc). Rows with none are returned as they
    were; O(biased + distinct history tokens) for the others."""
    if any(p.logits_processors for p in params):
        logits = _apply_processors(logits, params, _needs_histories(histories))
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_values: list[float] = []
    for r, p in enumerate(params):
        if p.logit_bias:
            bias_rows.extend([r] * len(p.logit_bias))
            bias_cols.extend(p.logit_bias)
            bias_values.extend(p.logit_bias.values())
    penalized = [r for r, p in enumerate(params) if p.penalized]
    if not bias_rows and not penalized:
        return _block_early_stops(logits, params, histories)
    logits = logits.astype(mx.float32)
    if bias_rows:
        logits = logits.at[mx.array(bias_rows), mx.array(bias_cols)].add(
            mx.array(bias_values, dtype=mx.float32)
        )
    if penalized:
        histories = _needs_histories(histories)
        logits = _apply_penalties(
            logits, [(r, params[r], _history(histories, r)) for r in penalized])
    return _block_early_stops(logits, params, histories)


def _block_early_stops(
    logits: mx.array, params: Sequence[SamplingParams], histories: Sequence[History | None] | None
) -> mx.array:
    """-inf at the stop tokens of the rows whose output is shorter than their
    `min_tokens` (last, so that no bias or penalty brings them back). Rows
    without `min_tokens` cost one attribute read; O(stop tokens) for the others."""
    rows: list[int] = []
    cols: list[int] = []
    for r, p in enumerate(params):
        if p.min_tokens and p.stop_token_ids:
            if len(_history(_needs_histories(histories), r)[1]) < p.min_tokens:
                rows.extend([r] * len(p.stop_token_ids))
                cols.extend(p.stop_token_ids)
    if not rows:
        return logits
    return logits.at[mx.array(rows), mx.array(cols)].add(-mx.inf)


def _needs_histories(histories: Sequence[History | None] | None) -> Sequence[History | None]:
    if histories is None:
        raise InvalidArgument("rows with penalties or logits processors need their token histories")
    return histories


def _history(histories: Sequence[History | None], row: int) -> History:
    """Row `row`'s history, which its penalties or processors need."""
    history = histories[row]
    if history is None:
        raise InvalidArgument(f"row {row} has penalties or logits processors but no token history")
    return history


def _apply_processors(
    logits: mx.array, params: Sequence[SamplingParams], histories: Sequence[History | None]
) -> mx.array:
    """Each row with processors through them, in order (mlx-lm's calling
    convention: the row's tokens so far, its logits ``[1, V]``)."""
    rows = []
    for r, p in enumerate(params):
        row = logits[r : r + 1]
        if p.logits_processors:
            prompt, output = _history(histories, r)
            tokens = mx.array(list(prompt) + list(output), dtype=mx.int32)
            for processor in p.logits_processors:
                row = processor(tokens, row)
        rows.append(row.astype(mx.float32))
    return mx.concatenate(rows)


def _apply_penalties(logits: mx.array, rows: list[tuple[int, SamplingParams, History]]) -> mx.array:
    """One gather and one scatter over every (row, history token) entry."""
    parts = [_penalty_entries(r, p, history) for r, p, history in rows]
    row_idx, tokens, counts, rep, presence, frequency = (
        np.concatenate([part[i] for part in parts]) for i in range(6)
    )
    if not len(tokens):
        return logits
    r, t = mx.array(row_idx), mx.array(tokens)
    values = logits[r, t]
    rep_m, counts_m = mx.array(rep), mx.array(counts)
    penalized = mx.where(values > 0, values / rep_m, values * rep_m)
    penalized = penalized - mx.array(presence) * (counts_m > 0) - mx.array(frequency) * counts_m
    return logits.at[r, t].add(penalized - values)


def _penalty_entries(row: int, params: SamplingParams, history: History) -> tuple:
    """(rows, distinct tokens, output counts, and each entry's repetition,
    presence and frequency penalty) of one row, as numpy arrays."""
    prompt, output = history
    out_tokens, out_counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    if params.repetition_penalty != 1.0:
        tokens = np.union1d(np.asarray(prompt, dtype=np.int64), out_tokens)
        counts = np.zeros(len(tokens), dtype=np.float32)
        counts[np.searchsorted(tokens, out_tokens)] = out_counts
    else:
        tokens, counts = out_tokens, out_counts.astype(np.float32)
    size = len(tokens)
    return (
        np.full(size, row, dtype=np.int64),
        tokens,
        counts,
        np.full(size, params.repetition_penalty, dtype=np.float32),
        np.full(size, params.presence_penalty, dtype=np.float32),
        np.full(size, params.frequency_penalty, dtype=np.float32),
    )


def token_logprobs(
    logits: mx.array, tokens: mx.array, num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Per row of `logits` ``[R, V]``: the log-probability of `tokens[r]`
    and the `num_top[r]` most likely tokens' (None where `num_top[r]` is
    None), from log_softmax of the logits. One evaluation for all rows."""
    picked = [r for r, k in enumerate(num_top) if k is not None]
    picked_top = [k for k in num_top if k is not None]  # num_top of the picked rows
    if not picked:
        return [None] * len(num_top)
    rows = mx.array(picked)
    logprobs = logits[rows].astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[rows].reshape(-1, 1), axis=-1)[:, 0]
    width = min(max(picked_top), logprobs.shape[-1])
    # `.tolist()` of 2-D / 1-D arrays: nested lists of token ids and float32 log-probabilities
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    if width:
        top = mx.argsort(-logprobs, axis=-1)[:, :width]
        top_values = mx.take_along_axis(logprobs, top, axis=-1)
        mx.eval(chosen, top, top_values)
        top_ids = cast("list[list[int]]", top.tolist())
        top_logprobs = cast("list[list[float]]", top_values.tolist())
    else:
        mx.eval(chosen)
    chosen_list = cast("list[float]", chosen.tolist())
    token_ids = cast("list[int]", tokens[rows].tolist())
    result: list[TokenLogprob | None] = [None] * len(num_top)
    for i, (r, k) in enumerate(zip(picked, picked_top)):
        pairs = tuple(zip(top_ids[i][:k], top_logprobs[i][:k])) if k else ()
        result[r] = TokenLogprob(token_ids[i], chosen_list[i], pairs)
    return result
