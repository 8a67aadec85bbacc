"""`SpeculativeModel`: mlx-lm's own speculative loop on paged views, hybrid models included.

mlx-lm's `speculative_generate_step(prompt, model, draft, prompt_cache=...)`
runs a forward over `[token, d1..dk]`, then `trim`s the caches back to the
accepted tokens (the draft's after its k one-token forwards). Recurrent
state cannot be cut token by token, and the views never see token ids, so
the model goes through this wrapper, which `PagedCache.speculative_model`
gives out with the views it feeds (`.cache`):

* each call records its input ids in the storage: ids already reserved
  (`allocate` / `append`, e.g. the prompt) are consumed, the others are
  appended inside a speculation transaction of the store, opened by the
  first call that appends (its checkpoint: the state after the computed
  tokens) and extended by the next calls until a trim;
* `trim(n)` on the views commits all but the last n speculative tokens; a
  hybrid sequence that dropped any gets its checkpoint back, and the
  tokens since it (ids known) are *replayed*: the next call computes them
  in front of its own input, in the same forward, and returns only the
  logits of its own input (the shape the bare model returns);
* consecutive rejections grow the replay (the checkpoint stays before it):
  a replay longer than the call's input + 1 runs first as a forward of its
  own (its logits never evaluated), which moves the checkpoint past it;
* a forward that raises leaves the storage as before the call: the step
  is rolled back and the transaction aborted (opened by this call) or
  shortened back (extended by it); a replay that ran alone first stays
  computed.

Cost per call: one synchronisation to read the input ids (mlx-lm's draft
loop otherwise overlaps its one-token forwards), the store calls (O(tokens)),
and after a restored checkpoint the replayed positions in the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Protocol, Sequence, cast

import mlx.core as mx

from blockmgr.errors import InvalidArgument
from cache.views import BatchState


class SpeculativeStorage(Protocol):
    """What the wrapper needs from its storage (the `PagedCache`)."""

    def num_computed(self, seq_id: Hashable) -> int: ...
    def num_tokens(self, seq_id: Hashable) -> int: ...
    def num_replay(self, seq_id: Hashable) -> int: ...
    def tokens(self, seq_id: Hashable) -> list[int]: ...
    def speculation_start(self, seq_id: Hashable) -> int | None: ...
    def begin_speculation(self, drafts: Mapping[Hashable, Sequence[int]]) -> Any: ...
    def append(self, seq_id: Hashable, new_tokens: Sequence[int]) -> Any: ...
    def abort_speculation(self, seq_ids: Sequence[Hashable]) -> Any: ...
    def shorten_speculation(self, kept: Mapping[Hashable, int]) -> None: ...
    def commit_step(self, batch: BatchState) -> None: ...
    def rollback_step(self, batch: BatchState) -> None: ...
    def eval_state(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Feed:
    """One call's plan: what each row computes and how the store changes.

    rows: each row's ids to compute (replayed, then the call's input);
    num_replayed: replayed ids in front of each row's input;
    new_tokens: ids each sequence gets appended (not reserved before);
    opens: this call opens the transactions (else it extends open ones,
        or, with nothing appended and none open, changes nothing);
    tails: speculative tokens each sequence held before the call (extension).
    """

    rows: tuple[tuple[int, ...], ...]
    num_replayed: tuple[int, ...]
    new_tokens: dict
    opens: bool
    tails: dict


class SpeculativeModel:
    """An mlx-lm model over a batch of `PagedCache` sequences, for mlx-lm's
    `speculative_generate_step` (see the module doc).

    ``target = pc.speculative_model(model, ["a"])``; likewise the draft on its
    own storage; then ``speculative_generate_step(prompt, target, draft,
    prompt_cache=target.cache + draft.cache)``. Reserve the prompt first
    (``pc.allocate("a", prompt)``) so that it is computed outside any
    transaction. Exposes `layers` and the model's call; `model` is the
    wrapped model.
    """

    def __init__(self, model: Any, storage: SpeculativeStorage, views: list,
                 batch: BatchState) -> None:
        self.model = model
        self.cache = views
        self._storage = storage
        self._batch = batch

    @property
    def layers(self) -> Any:
        return self.model.layers

    @property
    def seq_ids(self) -> tuple:
        return self._batch.seq_ids

    def __call__(self, inputs: mx.array, cache: Sequence | None = None, **kwargs) -> mx.array:
        """The model's logits for `inputs` ``[B, N]`` (row b: sequence b),
        computed on `self.cache`; replayed tokens go in front of a row's
        input and their logits are dropped. Raises `InvalidArgument`
        (nothing changed) for another cache or ids that differ from the
        reserved ones, the store's errors (`OutOfBlocks`, ...) when memory
        is short; a raising model leaves the storage as before (a replay
        that ran alone first stays computed: a state as valid as before)."""
        self._check_cache(cache)
        feed = self.plan(inputs)
        if max(feed.num_replayed) > inputs.shape[1] + 1:
            # Consecutive rejections grow the replay (the checkpoint stays
            # before it): past the input's width + 1 it runs alone, once.
            replayed = [r[:k] for r, k in zip(feed.rows, feed.num_replayed)]
            self._forward(replayed, inputs.dtype, kwargs)
            self._storage.eval_state()  # the writes only: its logits are never evaluated
            feed = self.plan(inputs)
        self._reserve(feed)
        try:
            logits = self._forward(feed.rows, inputs.dtype, kwargs)
        except BaseException:
            self._undo(feed)
            raise
        return _own_positions(logits, feed.num_replayed, inputs.shape[1])

    def _forward(self, rows: Sequence[Sequence[int]], dtype, kwargs) -> mx.array:
        """One forward of the (right-padded) rows, whose ids are reserved;
        committed when it returns, rolled back when it raises."""
        width = max(len(r) for r in rows)
        x = mx.array([list(r) + [0] * (width - len(r)) for r in rows], dtype=dtype)
        self._batch.feed([len(r) for r in rows])
        try:
            logits = self.model(x, cache=self.cache, **kwargs)
        except BaseException:
            self._batch.feed(None)
            self._storage.rollback_step(self._batch)
            raise
        self._storage.commit_step(self._batch)
        return logits

    def plan(self, inputs: mx.array) -> Feed:
        """The call's `Feed`, checked whole; changes nothing. Cost: reads
        the input ids (one synchronisation) and each row's pending ids."""
        seq_ids = self._batch.seq_ids
        if inputs.ndim != 2 or inputs.shape[0] != len(seq_ids) or inputs.shape[1] == 0:
            raise InvalidArgument(
                f"inputs of shape {tuple(inputs.shape)} for {len(seq_ids)} sequences: "
                "need [batch, N > 0]")
        storage = self._storage
        rows, num_replayed, new_tokens, tails = [], [], {}, {}
        for seq_id, ids in zip(seq_ids, cast(list[list[int]], inputs.tolist())):
            computed = storage.num_computed(seq_id)
            pending = storage.tokens(seq_id)[computed:]
            replay = pending[:storage.num_replay(seq_id)]
            reserved = pending[len(replay):]
            fed = ids[:len(reserved)]
            if fed != reserved[:len(fed)]:
                raise InvalidArgument(
                    f"{seq_id!r}: input ids {fed[:8]}... differ from its reserved tokens "
                    f"{reserved[:8]}...")
            rows.append(tuple(replay + ids))
            num_replayed.append(len(replay))
            new_tokens[seq_id] = ids[len(reserved):]
            start = storage.speculation_start(seq_id)
            if start is not None:
                tails[seq_id] = storage.num_tokens(seq_id) - start
        if tails and len(tails) != len(seq_ids):
            raise InvalidArgument(f"{list(seq_ids)!r}: only some sequences speculate")
        opens = not tails and any(new_tokens.values())
        return Feed(tuple(rows), tuple(num_replayed), new_tokens, opens, tails)

    def _reserve(self, feed: Feed) -> None:
        """Record the appended ids: open the transactions (all or nothing)
        or extend the open ones (undone whole if one append fails)."""
        storage = self._storage
        if feed.opens:
            storage.begin_speculation(feed.new_tokens)
            return
        if not feed.tails:
            return
        try:
            for seq_id, ids in feed.new_tokens.items():
                if ids:
                    storage.append(seq_id, ids)
        except BaseException:
            storage.shorten_speculation(feed.tails)
            raise

    def _undo(self, feed: Feed) -> None:
        if feed.opens:
            self._storage.abort_speculation(list(self._batch.seq_ids))
        elif feed.tails:
            self._storage.shorten_speculation(feed.tails)

    def _check_cache(self, cache: Sequence | None) -> None:
        views = self.cache
        if cache is None or len(cache) != len(views) or any(
                a is not b for a, b in zip(cache, views)):
            raise InvalidArgument(
                "a SpeculativeModel runs on its own views (`.cache`, mlx-lm's prompt_cache)")


def _own_positions(logits: mx.array, num_replayed: Sequence[int], n: int) -> mx.array:
    """Each row's logits at its own `n` input positions (after its replayed
    ids): ``[B, n, V]``, as the model returns for the input alone."""
    if len(set(num_replayed)) == 1:
        first = num_replayed[0]
        if first == 0 and logits.shape[1] == n:
            return logits
        return logits[:, first:first + n]
    index = mx.array([[r + j for j in range(n)] for r in num_replayed], dtype=mx.int32)
    return mx.take_along_axis(logits, index[:, :, None], axis=1)
