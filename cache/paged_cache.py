"""`PagedCache`: page pools, slot storage and the grouped store of one model.

Storage only: the bookkeeping of every layer group (one per distinct
attention window, group 0 also keeping the recurrent slots) is a pure-Python
`blockmgr.GroupedStore` (`store`). `PagedCache` is the facade over it: its
sequence calls have the store's meaning (the `KVStore` protocol) and queue
the plans they return, applied in one batched op per layer group before the
next forward (`flush`); it hands out the per-layer views. Its parts, each
with the protocol it asks of the others:

* `group_storage.GroupStorage`: each layer group's page pools, host swap
  pages, the plan queue and its batched application (`TierMoves`,
  `SlotPlans`);
* `computed_counts.ComputedCounts`: each sequence's computed count (the
  store's record, `blockmgr.Progress`), moved only once the forward that
  writes the tokens finished (`step`, see below; `CountedStore`), and what
  the cache tracks beside it;
* `batch_views.batch_views`: the views of one batch, laid out as the model's
  layers (`ViewPools`); `step_source.CacheSteps`: the `views.StepSource`
  they call (`StepHost`: the sequence calls a step makes);
* `cache_tiers.CacheTiers` (built by `tier_setup`): the prefix cache's host
  and disk tiers (`TieredStore`); `prefix_file`: one cached prefix as a
  file (`PrefixStorage`).

Recurrent layers (``ArraysCache``) keep their state in slots of a backend
(`RecurrentBackend`, e.g. `recurrent.RecurrentPools`) handed to the
constructor. `PagedCache.for_model` (the public way to build storage for an
mlx-lm model) reads the model and builds that backend through
`cache.model_storage`.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from blockmgr import (
    Allocation,
    GroupedStore,
    GroupedStoreConfig,
    PageGroupUsage,
    PrefixCacheStats,
    Progress,
)
from blockmgr.errors import (
    IntegrityError,
    InvalidArgument,
    SequenceSwapped,
    WrongArgumentType,
)
from blockmgr.ops import MemoryOp, Plan
from blockmgr.validation import decode_tokens
from cache import attention_hook, prefix_file
from cache.batch_views import batch_views
from cache.cache_tiers import CacheTiers, TierReport
from cache.computed_counts import ComputedCounts
from cache.group_storage import GroupStorage, layer_windows
from cache.layers import LayerKind, LayerSpec, LayoutEntry
from cache.model_storage import model_storage_parts
from cache.page_format import KVFormat, KVShape, PageStore, check_model
from cache.prefix_file import DeviceRecords
from cache.recurrent_backend import (  # noqa: F401 - importable from here before
    RecurrentBackend,
    RecurrentStepView,
)
from cache.speculative_model import SpeculativeModel
from cache.step_source import CacheSteps
from cache.tier_setup import model_fingerprint as fingerprint_of
from cache.tier_setup import open_tiers, record_stores, records_fingerprint, tier_sizes
from cache.views import BatchState

__all__ = ["PagedCache", "RecurrentBackend", "RecurrentStepView", "layer_windows"]


class PagedCache:
    """Paged KV storage + the grouped store of one model; see the module doc.

    Tokens given to `allocate`/`append` get pages reserved; the next forward
    through `step` (or `views`) computes them (all pending tokens, or the
    first N when the input has N < pending tokens: chunked prefill). A
    forward over a sequence with nothing pending reserves pages for its N
    input tokens itself (mlx-lm's `generate_step`); their ids are unknown,
    so they never enter the prefix trie.

    Sequence calls have the `blockmgr` meaning and return their plan (the
    `KVStore` protocol), which the cache also queues and applies itself: a
    caller never applies it.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int = 16,
        *,
        num_slots: int = 0,
        enable_prefix_cache: bool = True,
        watermark: float = 0.0,
        window_blocks: int | None = None,
        recurrent: RecurrentBackend | None = None,
        num_host_blocks: int = 0,
        num_host_slots: int = 0,
        paged_attention: bool = True,
        layout: Sequence[LayoutEntry] | None = None,
        kv_format: KVFormat | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        num_host_cache_blocks: int = 0,
        num_host_cache_slots: int = 0,
        num_disk_blocks: int = 0,
        num_disk_slots: int = 0,
        disk_cache: str | os.PathLike[str] | None = None,
        model_fingerprint: str | None = None,
        kv_shapes: Mapping[int, KVShape] | None = None,
        checkpoint_interval: float = 10.0,
    ) -> None:
        """`specs`: one per cache position (`layers.layer_specs`); `layout`
        nests positions into model layers (`layers.cache_layout`; None: one
        position per layer), so `views` gives a ``CacheList`` of views where
        the model keeps several caches in one layer.
        `window_blocks`: pages of each sliding-window group (default num_blocks).
        `num_host_blocks` / `num_host_slots`: swap space per group (host pages) and
        for recurrent state (the backend must have as many host slots).
        `paged_attention`: serve mlx-lm's attention calls from the pool in
        place (`cache.attention_hook`, installed process-wide) instead of
        from a gathered history; False always gathers.
        `kv_bits` (8 or 4) with `kv_group_size` (32, 64 or 128, default 64):
        affine-quantized pages for keys and values (mlx-lm's ``--kv-bits``);
        `kv_format` (a `KVFormat`, instead) sets key and value bits apart,
        e.g. ``KVFormat(key_bits=8, value_bits=4)``. Default: the model's
        dtype. A layer whose head size the group size does not divide
        raises `InvalidArgument` naming it at its first write (`for_model`
        checks the model when built).

        The prefix cache's colder tiers (design/tiers.md; `for_model` sizes
        them in bytes): `num_host_cache_blocks` / `num_host_cache_slots`
        pages per group and snapshots in host memory, `num_disk_blocks` /
        `num_disk_slots` on disk in the directory `disk_cache` (locked while
        open; what it held for the same `model_fingerprint`, block size,
        format and layout is restored: a request hits it). Tiers need
        `kv_shapes` (each attention position's kv heads, head sizes and
        dtype: the pools are allocated at once, so a load has somewhere to
        go before any forward). The index is written every
        `checkpoint_interval` seconds of disk activity and at `close`."""
        self.kv_format = KVFormat.of(kv_format, kv_bits, kv_group_size)
        specs = list(specs)
        has_recurrent = any(s.kind is LayerKind.RECURRENT for s in specs)
        if has_recurrent and (recurrent is None or num_slots < 1):
            raise InvalidArgument("recurrent layers need num_slots > 0 and a recurrent backend")
        num_slots = num_slots if has_recurrent else 0  # nothing would hold slot state
        num_host_slots = num_host_slots if has_recurrent else 0
        windows = layer_windows(specs)
        self.store = GroupedStore(
            GroupedStoreConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                windows=windows,
                num_slots=num_slots,
                enable_prefix_cache=enable_prefix_cache,
                watermark=watermark,
                window_blocks=window_blocks,
                num_host_blocks=num_host_blocks,
                num_host_slots=num_host_slots,
                num_host_cache_blocks=num_host_cache_blocks,
                num_host_cache_slots=num_host_cache_slots if has_recurrent else 0,
                num_disk_blocks=num_disk_blocks,
                num_disk_slots=num_disk_slots if has_recurrent else 0,
            )
        )
        self.specs = specs
        self._layout = None if layout is None else list(layout)
        self._paged_attention = paged_attention and attention_hook.install()
        self._recurrent = recurrent if has_recurrent else None
        self._reads_token_ids = any(s.kind is LayerKind.TOKENS for s in specs)
        self._counts = ComputedCounts(self.store, exact_snapshots=self._recurrent is not None)
        self._storage = GroupStorage(
            specs, [usage.num_pages for usage in self.store.group_usage()], block_size,
            self.kv_format, num_host_blocks)
        if kv_shapes is not None:
            self._storage.allocate(kv_shapes)
        self._tiers: CacheTiers | None = None
        self._model_fingerprint = model_fingerprint
        self._closed = False
        if self.store.config.has_cache_tiers:
            if kv_shapes is None:
                raise InvalidArgument(
                    "host and disk cache tiers need kv_shapes (PagedCache.for_model finds them)")
            self._tiers = open_tiers(
                self.store, self._storage.pools_by_group(), self._recurrent, block_size,
                self.kv_format, disk_cache, model_fingerprint, checkpoint_interval)

    @classmethod
    def for_model(
        cls,
        model: Any,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_slots: int = 0,
        recurrent: RecurrentBackend | None = None,
        num_host_slots: int = 0,
        host_cache_size: int | str | None = None,
        disk_cache: str | os.PathLike[str] | None = None,
        disk_cache_size: int | str | None = None,
        **kwargs: Any,
    ) -> PagedCache:
        """A cache laid out for `model` (layer kinds from `model.make_cache()`).

        For a hybrid model (``ArraysCache`` layers) give `num_slots` > 0; the
        recurrent storage defaults to ``recurrent.RecurrentPools.for_model(
        model, num_slots)`` (`cache.model_storage`); an attention-only model
        holds no slots whatever `num_slots` says. Layers that keep several
        caches (mlx-lm's ``CacheList``) get one view per cache, nested the
        same way. Other keywords go to the constructor (`kv_bits`,
        `kv_group_size`, `kv_format` among them). A quantized format is
        checked against the model's head sizes first (`page_format.
        check_model`, one one-token forward), so a layer it cannot store
        raises `InvalidArgument` here, naming the layer.

        The prefix cache's colder tiers (design/tiers.md): `host_cache_size`
        bytes of host memory and, with `disk_cache` (a directory),
        `disk_cache_size` bytes of disk (default 20 GiB); sizes are ints or
        strings like ``"4GiB"`` (`--kv-memory`'s syntax), turned into pages
        (and, for a hybrid model, snapshots) with the real page bytes of the
        model's format. A directory written for this model, block size and
        format is restored; `close()` (or leaving a ``with`` block) moves
        what is cached to disk for the next start.
        """
        parts = model_storage_parts(
            model, num_slots=num_slots, recurrent=recurrent, num_host_slots=num_host_slots
        )
        if host_cache_size is not None or disk_cache is not None:
            sizes = tier_sizes(cls, model, parts, block_size, KVFormat.of(
                kwargs.get("kv_format"), kwargs.get("kv_bits"), kwargs.get("kv_group_size")),
                host_cache_size, disk_cache, disk_cache_size)
            kwargs = {**sizes.kwargs(), **kwargs}
        elif disk_cache_size is not None:
            raise InvalidArgument("disk_cache_size needs disk_cache (a directory)")
        else:  # what an exported prefix's file is checked against
            kwargs.setdefault("model_fingerprint", fingerprint_of(model))
        storage = cls(
            parts.specs, num_blocks, block_size, num_slots=num_slots,
            recurrent=parts.recurrent, num_host_slots=num_host_slots, layout=parts.layout,
            **kwargs,
        )
        check_model(model, storage.kv_format)
        return storage

    # --- inspection ----------------------------------------------------------

    @property
    def block_manager(self) -> GroupedStore:
        """Deprecated (kept for one release): the store, `self.store`, which
        keeps every layer group."""
        return self.store

    @property
    def paged_attention(self) -> bool:
        """Attention calls are served from the pools in place (see `views`)."""
        return self._paged_attention

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if an invariant is broken: the store's (every
        group's, and their agreement), and this cache's sequences are the
        store's, with computed counts within their tokens."""
        self.store.check_integrity()
        self._counts.check_integrity()

    def check_no_leaks(self) -> None:
        """For the end of a run, when every sequence has ended: nothing but
        the prefix cache holds a page or a recurrent slot (device or host,
        swap space included), and dropping the device prefix cache frees
        every page and slot (`GroupedStore.check_no_leaks`). Raises
        `MemoryLeak` (an `IntegrityError`) naming what is held. Drops the
        device prefix cache. O(pages + cached prefixes)."""
        self.store.check_no_leaks()  # its sequences are this cache's (`check_integrity`)

    def debug_state(self) -> tuple[object, ...]:
        """The store's `debug_state()` and each sequence's computed state, as
        plain values: equal before and after a refused call. O(state)."""
        return self.store.debug_state(), self._counts.debug_state()

    @property
    def recurrent(self) -> RecurrentBackend | None:
        """The recurrent-state backend (None for attention-only models)."""
        return self._recurrent

    @property
    def block_size(self) -> int:
        return self.store.block_size

    @property
    def is_hybrid(self) -> bool:
        return self.store.is_hybrid

    @property
    def enable_prefix_cache(self) -> bool:
        return self.store.enable_prefix_cache

    @property
    def num_slots(self) -> int:
        return self.store.num_slots

    @property
    def num_usable_blocks(self) -> int:
        return self.store.num_usable_blocks

    @property
    def num_blocks(self) -> int:
        """Pages in the pool (of each page group)."""
        return self.store.config.num_blocks

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each page group's sliding window in tokens (None: full attention)."""
        return self.store.windows

    @property
    def usage(self) -> float:
        return self.store.usage

    @property
    def num_free_blocks(self) -> int:
        return self.store.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.store.num_cached_blocks

    @property
    def num_free_slots(self) -> int:
        return self.store.num_free_slots

    @property
    def num_groups(self) -> int:
        return self.store.num_groups

    @property
    def stats(self) -> PrefixCacheStats:
        return self.store.stats

    def group_usage(self) -> tuple[PageGroupUsage, ...]:
        return self.store.group_usage()

    @property
    def num_sequences(self) -> int:
        return self.store.num_sequences

    def sequence_ids(self) -> list[Hashable]:
        return self.store.sequence_ids()

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.store

    def slot(self, seq_id: Hashable) -> int | None:
        return self.store.slot(seq_id)

    def cached_prefix_length(self, tokens: Iterable[int], namespace: Hashable = None) -> int:
        return self.store.cached_prefix_length(tokens, namespace)

    def cached_paths(self) -> list[tuple[Hashable, list[int]]]:
        return self.store.cached_paths()

    def cached_tier_paths(self) -> list[tuple[Hashable, list[int], list[tuple[int, int]]]]:
        """`cached_paths()` with where each path's tiers begin (the store's
        `cached_tier_paths`). O(sum of the paths' lengths)."""
        return self.store.cached_tier_paths()

    def tier_report(self) -> tuple[TierReport, ...]:
        """Each prefix-cache tier's bytes, entries, hits and loads, device
        first (`CacheTiers.report`); empty without colder tiers. O(trie nodes)."""
        if self._tiers is None:
            return ()
        return self._tiers.report(self.store)

    @property
    def cache_version(self) -> int:
        return self.store.cache_version

    def take_listener_errors(self) -> list[tuple[str, BaseException]]:
        return self.store.take_listener_errors()

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.store.num_tokens(seq_id)

    def tokens(self, seq_id: Hashable) -> list[int]:
        """The sequence's token ids (placeholders where a forward fed ids the
        storage was not told)."""
        self._counts.state(seq_id)
        return self.store.tokens(seq_id)

    def num_computed(self, seq_id: Hashable) -> int:
        """Tokens of `seq_id` whose K/V a finished forward pass wrote."""
        return self._counts.state(seq_id).progress.num_computed

    def progress(self, seq_id: Hashable) -> Progress:
        """The sequence's computed count, the store's record (`blockmgr.Progress`),
        a step in flight settled first. O(1)."""
        return self._counts.state(seq_id).progress

    def block_table(self, seq_id: Hashable, group: int | None = None) -> list[int | None]:
        """Page table of `seq_id` in layer group `group` (default: group 0,
        full attention when the model has it; `group_of(layer)` names a
        layer's group)."""
        return self.store.block_table(seq_id, group)

    def group_of(self, layer: int) -> int:
        """The layer group of attention layer (cache position) `layer`."""
        return self._storage.group_of(layer)

    @property
    def nbytes(self) -> int:
        """Bytes of every allocated pool array (all pages, used or not; a
        quantized pool's packed values, scales and biases)."""
        return self._storage.nbytes

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the pages currently held (by sequences or the prefix
        trie), in the pages' format (scales and biases included)."""
        return self._storage.used_nbytes(
            [usage.num_pages - usage.num_free_pages for usage in self.store.group_usage()])

    # --- sequence calls (the store's meaning; plans queued and applied here) --

    def can_allocate(self, tokens: Iterable[int], namespace: Hashable = None) -> bool:
        """Would `allocate` succeed now? With a disk tier, the records a hit
        would load are read and verified first (unreadable ones forgotten),
        as `allocate` does: the answer is the one it will find."""
        if self._tiers is None:
            return self.store.can_allocate(tokens, namespace)
        return self._tiers.can_allocate(self.store, _token_list(tokens), namespace)

    def allocate(
        self, seq_id: Hashable, tokens: Iterable[int], namespace: Hashable = None, *,
        retention: int = 0,
    ) -> Allocation:
        """Reserve pages for a prompt, reusing the longest prefix every group
        can serve. Raises like `GroupedStore.allocate`, changing nothing.
        A hit in a colder tier is loaded back by the plan (disk records
        read and verified first: an unreadable one is a miss). `retention`:
        the sequence's retention priority (`GroupedStore.allocate`)."""
        if self._tiers is None:
            alloc = self.store.allocate(seq_id, tokens, namespace, retention=retention)
        else:
            alloc = self._tiers.allocate(self.store, seq_id, _token_list(tokens), namespace,
                                         retention)
        self._queue(alloc.ops)
        self._counts.add(seq_id, self.store.num_tokens(seq_id))
        return alloc

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        self._counts.state(seq_id)
        return self.store.can_append(seq_id, num_tokens)

    def can_append_decode(self, seq_ids: list[Hashable] | tuple[Hashable, ...]) -> bool:
        """Would `append_decode(seq_ids, tokens)` succeed now? Changes nothing."""
        for seq_id in seq_ids:
            self._counts.state(seq_id)
        return self.store.can_append_decode(seq_ids)

    def append(self, seq_id: Hashable, new_tokens: Iterable[int]) -> Plan:
        """Reserve pages for tokens the next forward computes. Raises
        `OutOfBlocks` (nothing changed) when any group lacks pages."""
        state = self._counts.state(seq_id)
        num_before = self.store.num_tokens(seq_id)
        # The count as it stands (forwards move it), not num_before: after a
        # restored checkpoint the tokens since it are computed again and a
        # window keeps their pages.
        plan = self.store.append(seq_id, new_tokens, state.progress.num_computed)
        self._queue(plan)
        self._counts.appended(seq_id, num_before)
        return plan

    def append_decode(
        self, seq_ids: list[Hashable] | tuple[Hashable, ...], tokens: Iterable[int]
    ) -> Plan:
        """`append` of one token to each of `seq_ids` (a decode step), whole
        or not at all: every row's room is checked first
        (`GroupedStore.can_append_decode`), then each row is appended as
        `append` does. Raises like `GroupedStore.append_decode`, nothing changed."""
        fits = self.store.can_append_decode(seq_ids)  # checks the ids
        tokens = decode_tokens(tokens, len(seq_ids))
        for seq_id in seq_ids:
            self._counts.state(seq_id)
        if not fits:
            self.store.append_decode(seq_ids, tokens)  # raises its error, changes nothing
            raise IntegrityError("append_decode succeeded where can_append_decode said no")
        ops: list[MemoryOp] = []
        for seq_id, token in zip(seq_ids, tokens):
            ops.extend(self.append(seq_id, [token]))
        return tuple(ops)

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> Plan:
        """`new_seq_id` shares `seq_id`'s pages (and slot) copy-on-write.
        Fork once every reserved token of `seq_id` is computed."""
        state = self._counts.state(seq_id)
        plan = self.store.fork(seq_id, new_seq_id)
        self._queue(plan)
        self._counts.add(new_seq_id, state.known)
        return plan

    def truncate(self, seq_id: Hashable, num_tokens: int) -> Plan:
        """Roll `seq_id` back to its first `num_tokens` tokens (speculative
        decoding: keep the accepted prefix). Raises like the store's
        truncate (e.g. rolling back into released window pages)."""
        self._counts.state(seq_id)
        plan = self.store.truncate(seq_id, num_tokens)
        self._queue(plan)
        self._counts.clip([seq_id])
        return plan

    def can_truncate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Would `truncate(seq_id, num_tokens)` succeed now? Changes nothing."""
        self._counts.state(seq_id)
        return self.store.can_truncate(seq_id, num_tokens)

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> Plan:
        """Snapshot computed tokens (None: all computed ones) into the tries.

        For a hybrid model the snapshot is the sequence's recurrent state, so
        only the computed end can be snapshot (a prefill chunk's end: call it
        between chunks); an earlier `num_tokens` raises `InvalidArgument`.
        """
        n = self._counts.snapshot_count(seq_id, num_tokens)
        if n == 0:
            return ()
        plan = self.store.cache_prefix(seq_id, n)
        self._queue(plan)
        return plan

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan:
        """End `seq_id`; its computed tokens (None: all) enter the tries.
        A step still in flight (a forward that never finished) counts as not
        computed; an open speculation is aborted first (drafts never enter)."""
        counts = self._counts
        n = counts.trie_count(seq_id, num_computed)
        if self.store.speculation_start(seq_id) is not None:
            self.abort_speculation([seq_id])
            n = counts.trie_count(seq_id, min(n, counts.state(seq_id).progress.num_computed))
        plan = self.store.free(seq_id, n)
        self._queue(plan)
        counts.remove(seq_id)
        return plan

    def reset_prefix_cache(self) -> None:
        self.store.reset_prefix_cache()

    # --- speculation (see design/speculation.md) ------------------------------

    def can_speculate(self, drafts: Mapping[Hashable, Iterable[int]]) -> bool:
        """Would `begin_speculation(drafts)` succeed now? Changes nothing."""
        return self.store.can_speculate(drafts)

    def begin_speculation(self, drafts: Mapping[Hashable, Iterable[int]]) -> Plan:
        """Reserve pages for each sequence's draft tokens (seq_id -> ids) and
        checkpoint its recurrent state, all at once or not at all (the
        store's `begin_speculation`). The drafts are pending tokens like
        appended ones; the next forward computes them."""
        if not isinstance(drafts, Mapping):
            raise WrongArgumentType(f"drafts must be a mapping, got {drafts!r:.80}")
        states = {s: self._counts.state(s) for s in drafts}
        num_before = {s: self.store.num_tokens(s) for s in drafts}
        # A hybrid checkpoint holds the state after the computed tokens: a
        # partial commit computes again from there (sliding windows keep it).
        num_computed = (
            {s: state.progress.num_computed for s, state in states.items()}
            if self.is_hybrid else None
        )
        plan = self.store.begin_speculation(drafts, num_computed)
        self._queue(plan)
        for s, before in num_before.items():
            self._counts.appended(s, before)
        return plan

    def commit_speculation(self, accepted: Mapping[Hashable, int]) -> frozenset[Hashable]:
        """Keep each sequence's first `accepted[seq_id]` drafts (all or
        nothing, the store's `commit_speculation`). Returns the ids whose
        checkpoint came back (a hybrid sequence that rejected a draft: its
        computed count is the checkpoint's, the tokens from there pending
        and computed again); `num_computed` reads each count after it."""
        if not isinstance(accepted, Mapping):
            raise WrongArgumentType(f"accepted must be a mapping, got {accepted!r:.80}")
        for s in accepted:
            self._counts.state(s)
        restored = self.store.commit_speculation(accepted)
        self._counts.clip(accepted)
        return restored

    def abort_speculation(self, seq_ids: Iterable[Hashable]) -> frozenset[Hashable]:
        """Drop every draft of `seq_ids` (as a commit keeping none); the ids
        whose checkpoint came back."""
        if isinstance(seq_ids, (str, bytes)):
            raise WrongArgumentType(f"seq_ids must be a collection of ids, got {seq_ids!r:.80}")
        return self.commit_speculation(dict.fromkeys(seq_ids, 0))

    def shorten_speculation(self, kept: Mapping[Hashable, int]) -> None:
        """Drop speculative tokens past `start + kept[seq_id]` that no
        forward computed, the transactions staying open (the store's
        `shorten_speculation`): undoes an `append` whose forward failed."""
        for s in kept:
            state = self._counts.state(s)
            if self.store.speculation_start(s) is None or state.in_flight:
                raise InvalidArgument(f"{s!r}: no speculation open, or a step in flight")
        self.store.shorten_speculation(kept)
        self._counts.clip(kept)

    def speculation_start(self, seq_id: Hashable) -> int | None:
        """The token count at `begin_speculation` (None: no transaction open)."""
        self._counts.state(seq_id)
        return self.store.speculation_start(seq_id)

    def speculative_model(self, model: Any, seq_ids: Sequence[Hashable]) -> SpeculativeModel:
        """`model` wrapped for mlx-lm's `speculative_generate_step` over the
        sequences `seq_ids` of this storage (see `cache.speculative_model`):
        its `cache` (the views to give mlx-lm) can be trimmed back to the
        start of the open speculation, hybrid models included."""
        views, batch = self._views(seq_ids, None, auto_commit=False)
        batch.speculative = True
        return SpeculativeModel(model, self, views, batch)

    # --- swap (preemption to host memory) ------------------------------------------

    def is_swapped(self, seq_id: Hashable) -> bool:
        self._counts.state(seq_id)
        return self.store.is_swapped(seq_id)

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Is there host memory (pages in every group, a host slot) to swap it out?"""
        self._counts.state(seq_id)
        return self.store.can_swap_out(seq_id)

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Are there device pages (and a slot) to bring it back? Changes nothing."""
        self._counts.state(seq_id)
        return self.store.can_swap_in(seq_id)

    def swap_out(self, seq_id: Hashable) -> Plan:
        """Move `seq_id`'s pages (and recurrent slot) to host memory, releasing
        the device copies; the sequence stays live but frozen until `swap_in`.

        Raises `OutOfHostMemory` (nothing changed) when any group lacks host
        space, `SequenceSwapped` when already out. The copies are applied by
        the next `flush` (in call order, before the device pages are reused);
        call `flush()` to free the memory now.
        """
        self._counts.state(seq_id)
        plan = self.store.swap_out(seq_id)
        self._queue(plan)
        return plan

    def swap_in(self, seq_id: Hashable) -> Plan:
        """Bring a swapped-out `seq_id` back to fresh device pages (and a slot).

        Raises like the store's `swap_in` (`OutOfBlocks` / `OutOfSlots`,
        nothing changed); copies are applied by the next `flush`.
        """
        self._counts.state(seq_id)
        plan = self.store.swap_in(seq_id)
        self._queue(plan)
        return plan

    # --- views and steps -----------------------------------------------------------

    @contextmanager
    def step(
        self, seq_ids: Sequence[Hashable], num_new: Sequence[int] | None = None
    ) -> Iterator[list]:
        """Views for one forward pass whose tokens count as computed only if
        it finishes: ``with pc.step(ids) as views: logits = model(x, cache=views)``.

        Leaving the block normally commits the step (and the recurrent state
        it wrote); an exception rolls it back, as if the forward never ran:
        the next forward computes the same tokens again and nothing unwritten
        can reach the prefix trie. Arguments as in `views`.
        """
        views, batch = self._views(seq_ids, num_new, auto_commit=False)
        try:
            yield views
        except BaseException:
            self.rollback_step(batch)
            raise
        self.commit_step(batch)

    def views(self, seq_ids: Sequence[Hashable], num_new: Sequence[int] | None = None) -> list:
        """One mlx-lm cache object per layer for the batch `seq_ids` (row order).

        Inputs are right-padded: row b's new tokens first. `num_new[b]`
        (first step only) says how many of the N input tokens of row b are
        real; default: min(pending tokens, N). Views live as long as the
        batch does (e.g. a whole `generate_step` run). A step's tokens count
        as computed at the next forward or the next call that touches the
        sequence (`free` included), if every layer that writes (attention,
        sliding, recurrent, composite) wrote its part of that step. A forward
        that raised midway is rolled back there instead, as `step` does, so no
        page a layer never wrote reaches the prefix trie; views rolled back by
        a call (rather than by their next forward) refuse further forwards
        (`InvalidArgument`): take new ones.
        """
        return self._views(seq_ids, num_new, auto_commit=True)[0]

    def _views(self, seq_ids, num_new, auto_commit: bool) -> tuple[list, BatchState]:
        seq_ids = list(seq_ids)
        try:
            distinct = len(set(seq_ids)) == len(seq_ids)
        except TypeError:
            distinct = False
        if not seq_ids or not distinct:
            raise InvalidArgument(f"need distinct sequence ids, got {seq_ids!r}")
        for s in seq_ids:
            self._counts.state(s)
            if self.store.is_swapped(s):
                raise SequenceSwapped(f"sequence {s!r} is swapped out; swap it in first")
        if num_new is not None and len(num_new) != len(seq_ids):
            raise InvalidArgument("num_new needs one entry per sequence")
        steps = CacheSteps(self, self.store, self._counts, self._storage, self._recurrent,
                           reads_token_ids=self._reads_token_ids,
                           paged_attention=self._paged_attention)
        batch = BatchState(steps, seq_ids, None if num_new is None else list(num_new),
                           auto_commit)
        return batch_views(batch, self.specs, self._layout, self._storage), batch

    def flush(self) -> None:
        """Apply every queued memory op: one gather + one scatter per pool array
        per batch of copies (usually one), one evaluation for all layers
        (`GroupStorage.apply`: page ops of a group no forward wrote yet are
        dropped); then the tiers' after-flush work (`CacheTiers.after_flush`)."""
        self._storage.apply(self._tiers, self._recurrent)
        if self._tiers is not None:
            self._tiers.after_flush(self.store)

    def eval_state(self) -> None:
        """Evaluate the K/V (and recurrent state) writes of the last forward
        without its outputs: for prefill chunks whose logits nobody samples,
        this skips the final layers' tail and the LM head."""
        self._storage.eval()
        if self._recurrent is not None:
            self._recurrent.flush()

    def commit_step(self, batch: BatchState) -> None:
        """The batch's last step finished: its tokens are computed and its
        recurrent writes go to the slots. Idempotent."""
        self._counts.commit_step(batch)

    def rollback_step(self, batch: BatchState) -> None:
        """The batch's last step failed: nothing of it counts (its recurrent
        writes are dropped; K/V written past the computed tokens are
        overwritten by the retry)."""
        self._counts.rollback_step(batch)

    def num_replay(self, seq_id: Hashable) -> int:
        """Tokens a trim's restored checkpoint made pending again, which a
        `SpeculativeModel` computes before its next input (the caller does
        not feed them again)."""
        return self._counts.num_replay(seq_id)

    def pool_for(self, layer: int, keys: mx.array | None,
                 values: mx.array | None) -> PageStore | None:
        """The layer's pool, created on its first write from the K/V shapes
        in the cache's `kv_format` (`InvalidArgument` naming the layer when
        the format cannot store its head sizes; nothing is created)."""
        return self._storage.pool_for(layer, keys, values)

    def pools(self) -> dict[int, PageStore]:
        """Every allocated pool, by attention position."""
        return self._storage.pools()

    # --- the prefix cache's tiers (design/tiers.md) -----------------------------

    @property
    def tiers(self) -> CacheTiers | None:
        """The host and disk storage of the prefix cache (None: device only)."""
        return self._tiers

    def pin(self, pin_id: Hashable, tokens: Iterable[int], namespace: Hashable = None) -> Plan:
        """Keep the cached prefix of `tokens` on the device and out of every
        eviction until `unpin(pin_id)` (a system prompt, a tool list): the
        store's `pin`, with a demoted prefix loaded back (disk records
        verified first). Nothing cached: nothing pinned. Raises like
        `GroupedStore.pin`, nothing changed."""
        if self._tiers is not None:
            tokens = _token_list(tokens)
            self._tiers.verified_match(self.store, tokens, namespace)
        plan = self.store.pin(pin_id, tokens, namespace)
        self._queue(plan)
        return plan

    def prefetch(self, tokens: Iterable[int], namespace: Hashable = None) -> int:
        """Start reading the disk records an `allocate(tokens, namespace)`
        would load, on a background thread (a waiting request's: the read
        overlaps other requests' forwards; the allocation then takes them).
        Changes nothing in the cache; returns the records queued (0 without
        a disk tier or a disk hit). O(matched tokens)."""
        tiers = self._tiers
        if tiers is None or tiers.disk is None:
            return 0
        return tiers.prefetch(self.store, _token_list(tokens), namespace)

    def unpin(self, pin_id: Hashable) -> None:
        """Let the prefix `pin(pin_id, ...)` kept be evicted again."""
        self.store.unpin(pin_id)

    def pinned(self) -> dict[Hashable, int]:
        """Each pin's id and the tokens it keeps cached."""
        return self.store.pinned()

    # --- one prefix as a file (cache/prefix_file.py) ---------------------------

    def export_prefix(self, tokens: Iterable[int], path: str | os.PathLike[str],
                      namespace: Hashable = None, *, retention: int = 0) -> int:
        """Write the cached prefix of `tokens` (in `namespace`; wherever its
        tier: a demoted one is loaded back first) to the file `path`, in the
        disk tier's record format; returns its tokens. Raises
        `InvalidArgument` when nothing of `tokens` is cached, for a sliding
        window's prefix whose early pages were released, for a cache
        without a model fingerprint (`for_model` gives one) or pools (its
        first forward, or cache tiers, allocates them); `OutOfBlocks` when
        the device has no room to load it. The cache is left as it was,
        but for the export being a use: the prefix is the most recently
        used, with retention priority `retention`. O(prefix pages + file
        bytes)."""
        return prefix_file.export_prefix(self, self._device_records(), _token_list(tokens),
                                         path, namespace, retention)

    def import_prefix(self, path: str | os.PathLike[str], *, retention: int = 0) -> int:
        """Cache the prefix an `export_prefix` of this model (same block
        size, format and layout) wrote to `path`, in its namespace; returns
        its tokens, with retention priority `retention`. A later prompt
        starting with it hits it, with the logits of a prefix never
        evicted. Raises `ForeignPrefixFile` for another model's file,
        `CorruptPrefixFile` for a cut or damaged one,
        `OutOfBlocks` / `OutOfSlots` without room: nothing changed then.
        O(file bytes)."""
        return prefix_file.import_prefix(self, self._counts, self._device_records(), path,
                                         retention)

    @property
    def pools_ready(self) -> bool:
        """Is every attention position's pool allocated (by a first forward,
        or up front for cache tiers)? Prefix files need them."""
        return self._storage.ready

    def _device_records(self) -> DeviceRecords:
        """The device records and their fingerprint, for a prefix file."""
        if not self._model_fingerprint:
            raise InvalidArgument("prefix files need the model's fingerprint: build the cache "
                                  "with PagedCache.for_model")
        if not self.pools_ready:
            raise InvalidArgument("prefix files need the pools allocated: run a forward first "
                                  "or build the cache with cache tiers")
        pages, slots = record_stores(self._storage.pools_by_group(), self._recurrent,
                                     self.store.is_hybrid)
        return DeviceRecords(pages, slots, records_fingerprint(
            self._model_fingerprint, self.block_size, self.kv_format, pages, slots))

    def checkpoint(self) -> None:
        """Queue the disk tier's index as it is now (written by the writer
        thread after the records queued before it). No-op without a disk."""
        if self._tiers is not None:
            self._tiers.checkpoint(self.store)

    def close(self) -> None:
        """Shut the tiers down gracefully: every pin released, every cached
        prefix no live sequence uses moved to disk (`flush_to_disk`), the
        writes finished, the index written, the directory unlocked. A
        restart on the same directory finds them. Idempotent; the cache
        takes no further calls that need the disk."""
        if self._closed:
            return
        self._closed = True
        tiers = self._tiers
        if tiers is None or tiers.disk is None:
            return
        for pin_id in list(self.store.pinned()):
            self.store.unpin(pin_id)
        tiers.stop_reader()
        self._queue(self.store.flush_to_disk())
        self.flush()
        tiers.close_disk(self.store)  # a no-op if the flush found the disk failed

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------

    def _queue(self, ops: Iterable[MemoryOp]) -> None:
        """Queue a plan for the next `flush`."""
        self._storage.queue(ops)


def _token_list(tokens: Iterable[int]) -> Sequence[int]:
    """`tokens` as something that can be read twice (a match, then the
    allocation): lists, tuples and arrays as they are."""
    if isinstance(tokens, (list, tuple)) or type(tokens).__name__ == "ndarray":
        return tokens  # type: ignore[return-value]
    return list(tokens)
