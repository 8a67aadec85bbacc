"""`BlockManager`: pages, recurrent slots and the prefix trie of many sequences.

The manager decides; it never touches tensors. Each call that implies storage
work returns a memory-op plan (`blockmgr.ops`) for the storage to apply, in
call order, before the next forward pass.

Life of a sequence:

    allocate(id, prompt)   pages for every prompt token; a prefix found in the
                           trie is shared, the rest is to be computed
    append(id, tokens)     pages for tokens about to be computed; a shared page
                           or slot about to be written is copied first (CoW)
    fork(id, new_id)       share everything; CoW on the next write
    truncate(id, n)        roll back (speculative decoding)
    cache_prefix(id, n)    snapshot the computed prefix into the trie
    free(id, num_computed) the computed tokens (and slot) go into the trie

A manager keeps one or more page groups (`blockmgr.page_group`: a model's
layer groups, one per attention window), all alike: every sequence has one
page table per group, every trie node one page list per group, and every
call checks every group before it changes any. A plain `BlockManager` keeps
the one group its config describes; `GroupedStore` keeps a model's groups.

Every call either succeeds whole or raises and changes nothing. Arguments
are checked (`blockmgr.validation`) before anything changes: token ids are
non-negative ints (lists, tuples, iterables, numpy integer arrays), ids and
namespaces hashable. `free` of a live id never fails. Prefix-cache listener
calls run when a call has finished; their errors are kept
(`take_listener_errors`), never raised into the caller. The whole contract
of every layer: design/errors.md. The speculation transaction and host swap
are done by helpers the manager owns (`blockmgr.speculation`,
`blockmgr.swap`), behind the same public calls.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from collections.abc import Sequence as Seq

from blockmgr.checks import StoreChecks
from blockmgr.config import BlockManagerConfig, GroupedStoreConfig
from blockmgr.errors import (
    DuplicateSequence,
    IntegrityError,
    InvalidArgument,
    MemoryLeak,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
    UnknownSequence,
    WrongArgumentType,
)
from blockmgr.growth import Growth, grow, plan_growth
from blockmgr.ops import NO_OPS, CopySlot, MemoryOp, Plan, Tier, ZeroSlot
from blockmgr.page_group import PageGroup, windows_keep
from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import PrefixTrie
from blockmgr.sequence import Allocation, Progress, Sequence, SequenceTable
from blockmgr.speculation import SpeculationTransactions
from blockmgr.stats import PageGroupUsage, PrefixCacheStats
from blockmgr.swap import HostSwap
from blockmgr.tiered_trie import DiskEntry, TierCapacity, TieredTrie, TierUsage
from blockmgr.trie_node import TOKEN_BYTES, PrefixCacheListener, PrefixEvent, PrefixMatch, TrieNode
from blockmgr.validation import (
    MAX_TOKEN_ID,
    check_count,
    check_hashable,
    check_int,
    decode_tokens,
    packed_prompt,
    prompt_list,
    token_list,
)


class BlockManager:
    """Bookkeeping of KV pages, recurrent slots and cached prefixes.

    Not thread-safe: one scheduler drives it. Costs are per call and do not
    depend on the number of live sequences; page work is O(pages touched x
    groups), trie work O(matched tokens + depth).
    """

    def __init__(
        self,
        config: BlockManagerConfig | GroupedStoreConfig,
        listener: PrefixCacheListener | None = None,
        *,
        group: int = 0,
    ) -> None:
        """`config`: one page group (`BlockManagerConfig`) or a model's
        groups (`GroupedStoreConfig`). `listener` follows the first group's
        prefix cache (`PrefixCacheListener`). `group`: the number the first
        group's page ops carry (see `blockmgr.ops`; the others follow)."""
        if not isinstance(config, (BlockManagerConfig, GroupedStoreConfig)):
            raise InvalidArgument(f"config must be a BlockManagerConfig, got {config!r}")
        self.config = config
        self._groups = tuple(
            PageGroup.build(index, group + index, group_config)
            for index, group_config in enumerate(config.group_configs())
        )
        self._first_group = group
        #: Each group's watermark pages (None: all 0, the common case).
        self._watermarks = (
            tuple(g.num_watermark_pages for g in self._groups)
            if any(g.num_watermark_pages for g in self._groups) else None
        )
        self._block_size = config.block_size
        #: Some group has a sliding window (appends then track computed counts).
        self._windowed = any(g.window is not None for g in self._groups)
        # What the room tests (`_has_room_for_next_token`, `_rows_without_room`)
        # read of each group, bound once: they run per decoded token.
        self._room_checks = tuple(
            (g.index, g.pages.live_refcounts(), g.window) for g in self._groups)
        self._slots = RefCountedPool(config.num_slots) if config.is_hybrid else None
        self._host_slots = RefCountedPool(config.num_host_slots)
        self._seqs = SequenceTable()
        self._pins: dict[Hashable, TrieNode] = {}  # pin id -> the node it locks
        self._trie = self._new_trie(config, listener) if config.enable_prefix_cache else None
        self._speculation = SpeculationTransactions(self._groups, self._slots, self._seqs)
        self._swap = HostSwap(self._groups, self._slots, self._host_slots)
        self._checks = StoreChecks(
            self._groups, self._slots, self._host_slots, self._seqs, self._block_size)
        # Listener calls queued by the trie, delivered when a call is done.
        self._events: list[PrefixEvent] = self._trie.events if self._trie is not None else []
        self._listener_errors: list[tuple[str, BaseException]] = []
        self._num_queries = 0
        self._num_hits = 0
        self._num_query_tokens = 0
        self._num_hit_tokens = 0

    def _new_trie(
        self, config: BlockManagerConfig | GroupedStoreConfig, listener: PrefixCacheListener | None
    ) -> PrefixTrie:
        """The prefix cache: a `TieredTrie` when host or disk tiers are asked for."""
        groups = [(g.pages, g.window) for g in self._groups]
        if not config.has_cache_tiers:
            return PrefixTrie(config.block_size, groups, self._slots, listener)
        host = disk = None
        if config.num_host_cache_blocks:
            host = TierCapacity(config.num_host_cache_blocks, config.num_host_cache_slots)
        if config.num_disk_blocks:
            disk = TierCapacity(config.num_disk_blocks, config.num_disk_slots)
        return TieredTrie(config.block_size, groups, self._slots, listener, host=host, disk=disk,
                          first_group=self._first_group)

    # ------------------------------------------------------------- queries

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def is_hybrid(self) -> bool:
        """True when sequences carry recurrent state (slots)."""
        return self._slots is not None

    @property
    def enable_prefix_cache(self) -> bool:
        return self._trie is not None

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each page group's sliding window (None: full attention)."""
        return tuple(g.window for g in self._groups)

    @property
    def num_usable_blocks(self) -> int:
        """Pages one sequence may hold in an empty store: the pool past its
        watermark (the smallest group's)."""
        return min(g.num_usable_pages for g in self._groups)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def sequence_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def block_table(self, seq_id: Hashable, group: int | None = None) -> list[int | None]:
        """A copy of the sequence's page table (None: released by a window)
        in page group `group` (None: the first)."""
        seq = self._seqs.live(seq_id)
        return list(seq.tables[0 if group is None else self._group_index(group)])

    def page_refcount(self, page: int, group: int | None = None) -> int:
        """The references held on device page `page` of page group `group`
        (None: the first): one per trie node that holds it, one per
        sequence whose table holds it as its own (a page a sequence borrows
        from the node it locks counts only the node's); 0: the page is free.
        The counts `check_integrity` recounts. Refuses a page or group out
        of range (`InvalidArgument`). O(1)."""
        pages = self._groups[0 if group is None else self._group_index(group)].pages
        return pages.refcount(check_int("page", page, 0, pages.num_items - 1))

    def group_usage(self) -> tuple[PageGroupUsage, ...]:
        """Each page group's pool, free, cached and evicted pages. O(groups)."""
        trie = self._trie
        return tuple(
            PageGroupUsage(
                g.group, g.window, g.pages.num_items, g.pages.num_free,
                trie.num_pages_held(g.index) if trie is not None else 0,
                trie.num_evicted_pages(g.index) if trie is not None else 0,
                g.host_pages.num_items, g.host_pages.num_free,
            )
            for g in self._groups
        )

    def tier_usage(self) -> tuple[TierUsage, ...]:
        """The prefix cache's tiers (device, then host and disk when it has
        them): nodes, pages per group and slots in use, pages demoted and
        loaded so far. Empty without cache tiers. O(nodes)."""
        if not isinstance(self._trie, TieredTrie):
            return ()
        return self._trie.tier_usage()

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._seqs.live(seq_id).tokens)

    def progress(self, seq_id: Hashable) -> Progress:
        """The sequence's computed count, the record itself (`Progress`: read
        it, or set it when a forward computed its tokens). O(1)."""
        return self._seqs.live(seq_id)

    def num_computed(self, seq_id: Hashable) -> int:
        """How many of the sequence's tokens are computed (`Progress`). O(1)."""
        return self._seqs.live(seq_id).num_computed

    def tokens(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs.live(seq_id).tokens)

    def slot(self, seq_id: Hashable) -> int | None:
        return self._seqs.live(seq_id).slot

    def namespace(self, seq_id: Hashable) -> Hashable:
        return self._seqs.live(seq_id).namespace

    @property
    def num_free_blocks(self) -> int:
        """Pages free right now in the group with the fewest (the binding
        one; pages held only by the trie are not counted). O(groups)."""
        groups = self._groups
        if len(groups) == 1:
            return groups[0].pages.num_free
        return min(g.pages.num_free for g in groups)

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free if self._slots is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        """Free host pages of the group with the fewest. O(groups)."""
        return min(g.host_pages.num_free for g in self._groups)

    @property
    def num_free_host_slots(self) -> int:
        return self._host_slots.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Distinct pages held by the prefix trie (some shared with
        sequences), over every group. O(groups)."""
        if self._trie is None:
            return 0
        return sum(map(self._trie.num_pages_held, range(len(self._groups))))

    @property
    def usage(self) -> float:
        """Fraction of pages in use by sequences or the trie, in the fullest
        group. O(groups): it is read once per simulated step."""
        groups = self._groups
        if len(groups) == 1:
            pages = groups[0].pages
            return pages.num_used / pages.num_items
        return max(g.pages.num_used / g.pages.num_items for g in groups)

    @property
    def stats(self) -> PrefixCacheStats:
        """Queries, hits and the trie's nodes, with the pages (held,
        evicted) of every group summed. O(groups)."""
        trie = self._trie
        return PrefixCacheStats(
            num_queries=self._num_queries,
            num_hits=self._num_hits,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evicted_pages=(
                sum(map(trie.num_evicted_pages, range(len(self._groups)))) if trie else 0
            ),
            num_evicted_nodes=trie.num_evicted_nodes if trie else 0,
            num_trie_nodes=trie.num_nodes if trie else 0,
            num_trie_pages=self.num_cached_blocks,
            num_trie_slots=trie.num_slots_held if trie else 0,
        )

    # --------------------------------------------------------------- allocate

    def cached_prefix_length(self, tokens: Iterable[int], namespace: Hashable = None) -> int:
        """How many tokens `allocate` would reuse right now. Changes nothing.

        For admission control that counts only new tokens against a budget.
        O(matched tokens + depth).
        """
        checked, packed = packed_prompt(tokens, "tokens")
        check_hashable("namespace", namespace)
        return self._match(namespace, checked, packed).num_tokens

    @property
    def cache_version(self) -> int:
        """A number that grows whenever the prefix cache may have changed
        (an insert, an eviction, a dropped snapshot); equal numbers mean
        every hit is as it was. O(1)."""
        return 0 if self._trie is None else self._trie.version

    def cached_paths(self) -> list[tuple[Hashable, list[int]]]:
        """`(namespace, tokens)` of every maximal cached prefix (the trie's
        leaves): each cached prefix starts one of them. What a hit can
        really use along one is `cached_prefix_length(tokens + [t])`, as
        the tokens past the last snapshot or window are not servable.
        For a cache-aware router's view (`scheduler.engine.kv_events`). Pure;
        O(sum of the paths' lengths)."""
        return [] if self._trie is None else self._trie.cached_paths()

    def cached_tier_paths(self) -> list[tuple[Hashable, list[int], list[tuple[int, int]]]]:
        """`cached_paths()`, each with the token positions where its tiers
        begin (`(start, Tier)` runs, the device's first; without colder
        tiers one device run). For KV events naming each block's medium.
        Pure; O(sum of the paths' lengths)."""
        return [] if self._trie is None else self._trie.cached_tier_paths()

    def find_prefix(
        self,
        tokens: Iterable[int],
        namespace: Hashable = None,
        limit: int | None = None,
        *,
        packed: bytes | None = None,
    ) -> PrefixMatch:
        """The longest cached prefix of `tokens` this manager can serve (in
        every page group), at most `limit` tokens (default and cap:
        len - 1). Changes nothing.

        A hit is not downward closed (a recurrent snapshot or a sliding
        window's pages exist only at some points): the longest hit within
        `limit` may be well below it. Pass the result to `allocate(match=...)`
        before any other call on this manager. `packed`: what
        `validation.packed_prompt` returned for `tokens` (then `tokens` is
        its checked list, not checked or packed again). O(matched tokens +
        depth).
        """
        checked, packed = self._checked_prompt(tokens, namespace, packed)
        if limit is not None:
            limit = check_count("limit", limit)
        return self._match(namespace, checked, packed, limit)

    def can_allocate(
        self,
        tokens: Iterable[int],
        namespace: Hashable = None,
        *,
        match: PrefixMatch | None = None,
        packed: bytes | None = None,
    ) -> bool:
        """Would `allocate(..., tokens, namespace, match=match)` succeed now?
        Changes nothing. `packed` as in `find_prefix`."""
        checked, packed = self._checked_prompt(tokens, namespace, packed)
        if match is None:
            match = self._match(namespace, checked, packed)
        needs = self._allocation_needs(len(checked), match.num_tokens)
        if match.loads:
            if self._can_load_hit(match, needs):
                return True
            match = self._device_part(namespace, checked, packed, match)
            needs = self._allocation_needs(len(checked), match.num_tokens)
        if self._fits(needs, 1):
            return True  # the common case: no eviction, so nothing to protect
        if not match.num_tokens:
            return self._room_error("need", needs, 1) is None
        self._hold_match(match)
        try:
            return self._room_error("need", needs, 1) is None
        finally:
            self._release_match(match)

    def allocate(
        self,
        seq_id: Hashable,
        tokens: Iterable[int],
        namespace: Hashable = None,
        *,
        retention: int = 0,
        match: PrefixMatch | None = None,
        packed: bytes | None = None,
    ) -> Allocation:
        """Reserve pages (and a slot) for a new sequence's prompt.

        `retention`: the sequence's retention priority, an int (default
        0). The cached prefixes it hits, and those it caches (`free`,
        `cache_prefix`), take it; under memory pressure a prefix of lower
        priority is evicted (or demoted to a colder tier) before any of
        higher priority, least recently used first within one priority.
        A prefix's priority is that of the last sequence that hit or cached
        it (pin a prefix to keep it whatever comes).

        Shares the longest usable cached prefix (or `match`, a `find_prefix`
        result of this manager with no call in between; `packed` as in
        `find_prefix`, and then the manager keeps that `tokens` list as the
        sequence's own: pass one nothing else holds); `num_cached_tokens`
        of the result says how many tokens need no compute (at most len - 1).
        Evicts least recently used cache entries when memory is short; raises
        `OutOfBlocks` / `OutOfSlots` (changing nothing) when that is not
        enough, `DuplicateSequence` for a live id. O(prompt pages x groups +
        matched tokens).
        """
        self._seqs.check_new_id(seq_id)
        checked, packed = self._checked_prompt(tokens, namespace, packed)
        if type(retention) is not int:  # an exact int needs no check
            retention = check_int("retention", retention, None)
        if match is None:
            match = self._match(namespace, checked, packed)
        num_tokens, num_cached = len(checked), match.num_tokens
        needs = self._allocation_needs(num_tokens, num_cached)
        if match.loads and not self._can_load_hit(match, needs):
            match = self._device_part(namespace, checked, packed, match)
            num_cached = match.num_tokens
            needs = self._allocation_needs(num_tokens, num_cached)
        ops: list[MemoryOp] = []
        if match.loads:  # colder tiers' pages: back to the device first
            match = self._load_hit(namespace, checked, packed, match, needs, ops)
        if num_cached:
            self._hold_match(match)
        try:
            ops.extend(self._reserve(needs, 1))
        except (OutOfBlocks, OutOfSlots):
            if num_cached:
                self._release_match(match)
            raise
        trie = self._trie
        if match.path and trie is not None:
            trie.touch(match.path, retention)
        tables = []
        for group in self._groups:
            tables.append(group.new_table(match, num_tokens, ops))
        slot = self._new_sequence_slot(match.slot, ops) if self._slots is not None else None
        node = match.node  # ends inside the matched prefix: an anchor
        seq = self._seqs[seq_id] = Sequence(
            seq_id,
            namespace,
            checked,
            tables,
            list(match.released) if num_cached else [0] * len(tables),
            slot,
            node,
            anchored=node is not None,
            num_borrowed=match.num_locked_pages,
            packed=packed,
            num_computed=num_cached,
            retention=retention,
            branch_point=match.branch_point,
        )
        self._count_query(num_tokens, num_cached)
        if self._events:
            self._deliver_events()
        return Allocation(seq_id, tables[0][:], slot, tuple(ops), num_cached, seq,
                          match.branch_point)

    def _load_hit(
        self,
        namespace: Hashable,
        tokens: list[int],
        packed: bytes,
        match: PrefixMatch,
        needs: list[int],
        ops: list[MemoryOp],
    ) -> PrefixMatch:
        """Bring a hit's demoted nodes back to the device (their room, and the
        allocation's `needs`, reserved with the whole path locked: nothing
        it uses is evicted meanwhile) and match again; the moves go to `ops`.
        Raises `OutOfBlocks` / `OutOfSlots`, changing nothing, when the
        device cannot take them."""
        trie = self._tiered
        deepest = match.path[-1]
        load_pages, load_slots = trie.load_needs(match)
        trie.defer_merges()  # the hit's nodes stay as they are until loaded
        trie.lock(deepest)
        try:
            ops.extend(self._reserve([n + m for n, m in zip(needs, load_pages)], 1 + load_slots))
            trie.load(match.loads)
            ops.extend(trie.take_ops())
        finally:
            trie.unlock(deepest)
            trie.resume_merges()
        loaded = trie.match(namespace, tokens, match.num_tokens, packed)
        if loaded.num_tokens != match.num_tokens or loaded.loads:
            raise IntegrityError("a loaded hit matched differently")
        return loaded

    def _device_part(
        self, namespace: Hashable, tokens: list[int], packed: bytes, match: PrefixMatch
    ) -> PrefixMatch:
        """A miss: what to use when loading the whole hit and the new pages
        do not fit together (a demoted node is loaded whole, however little
        of it the hit uses; a request must not wait for room it would not
        need as a miss). A miss, not the hit's device part: a part ending
        inside a node beside its demoted descendants is not a state the
        trie's invariants cover."""
        return self._match(namespace, tokens, packed, 0)

    def _can_load_hit(self, match: PrefixMatch, needs: list[int]) -> bool:
        """Would `_load_hit` find the room? Pure (the path locked meanwhile)."""
        trie = self._tiered
        load_pages, load_slots = trie.load_needs(match)
        trie.lock(match.path[-1])
        try:
            return self._room_error(
                "need", [n + m for n, m in zip(needs, load_pages)], 1 + load_slots
            ) is None
        finally:
            trie.unlock(match.path[-1])

    def _checked_prompt(
        self, tokens: Iterable[int], namespace: Hashable, packed: bytes | None
    ) -> tuple[list[int], bytes]:
        """The prompt as a checked list and its packed bytes (trusted when
        `packed` is given: the caller checked both)."""
        if packed is not None:
            return tokens, packed  # type: ignore[return-value]  # the caller's checked list
        check_hashable("namespace", namespace)
        if self._trie is None:  # nothing to match against: no packing
            return prompt_list(tokens, "tokens"), b""
        return packed_prompt(tokens, "tokens")

    def _allocation_needs(self, num_tokens: int, num_cached: int) -> list[int]:
        """Pages each group must have free to allocate a prompt of
        `num_tokens` with `num_cached` of them matched: the new pages, a copy
        of a partly matched last page, and the group's watermark."""
        block_size = self._block_size
        # ceil(tokens) - ceil(cached) + (a copy of a partly matched page) pages
        num_pages = -(-num_tokens // block_size) - num_cached // block_size
        if self._watermarks is None:
            return [num_pages] * len(self._groups)
        return [num_pages + watermark for watermark in self._watermarks]

    def _hold_match(self, match: PrefixMatch) -> None:
        """Keep the matched pages alive through eviction: a lock on the nodes
        wholly inside the hit (it keeps their pages: those are borrowed),
        and the sequence's own references to the pages past them. A hit
        (`match.num_tokens` > 0) only."""
        if match.node is not None and self._trie is not None:
            self._trie.lock(match.node)
        for group in self._groups:
            group.hold_match(match)

    def _release_match(self, match: PrefixMatch) -> None:
        """Undo `_hold_match` (the trie still holds the pages: none is freed)."""
        if match.node is not None and self._trie is not None:
            self._trie.unlock(match.node)
        for group in self._groups:
            group.release_match(match)

    def _new_sequence_slot(self, snapshot: int | None, ops: list[MemoryOp]) -> int:
        """A fresh slot (hybrid only), zeroed or copied from the snapshot."""
        slot = self._slot_pool.take_one()
        ops.append(ZeroSlot(slot) if snapshot is None else CopySlot(snapshot, slot))
        return slot

    def _count_query(self, num_tokens: int, num_cached: int) -> None:
        self._num_queries += 1
        self._num_query_tokens += num_tokens
        if num_cached:
            self._num_hits += 1
            self._num_hit_tokens += num_cached

    # ----------------------------------------------------------------- append

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Would `append` of `num_tokens` tokens succeed now? Changes nothing."""
        seq = self._seqs.resident(seq_id)
        num_tokens = check_count("num_tokens", num_tokens)
        if num_tokens == 1 and self._has_room_for_next_token(seq):
            return True  # the common decode step: room in the last page (`append`'s test)
        growth = self._growth(seq, num_tokens)
        return not growth.grows or self._room_error("need", growth.needs, growth.copy_slot) is None

    def append(
        self, seq_id: Hashable, new_tokens: Iterable[int], num_computed: int | None = None
    ) -> Plan:
        """Reserve pages for tokens about to be computed; returns the plan.

        A partly filled last page or a slot shared with another owner is
        copied first (CoW). With a sliding window, pages no longer visible to
        the first token still to compute are released: `num_computed` is
        the count of computed tokens (None: every token before the new ones,
        or, after a commit restored a checkpoint, its position, kept until a
        count is given). O(groups) amortised per token.
        """
        try:
            seq = self._seqs[seq_id]  # the common case at C speed; the lookup below names it
        except (KeyError, TypeError):
            seq = self._seqs.resident(seq_id)
        if seq.swapped:
            self._seqs.resident(seq_id)  # raises
        if num_computed is not None:
            num_computed = check_int("num_computed", num_computed, 0, len(seq.tokens))
        if not (  # a decode step's one checked token (`extend` copies it)
            type(new_tokens) is list
            and len(new_tokens) == 1
            and type(new_tokens[0]) is int
            and 0 <= new_tokens[0] <= MAX_TOKEN_ID
        ):
            new_tokens = token_list(new_tokens, "new_tokens")
            if not new_tokens:
                return NO_OPS
        elif (
            num_computed is None or num_computed == len(seq.tokens)
        ) and self._has_room_for_next_token(seq):
            # The common decode step: nothing to plan, every token before it
            # computed (no hold: `_has_room_for_next_token` says so).
            seq.num_computed = len(seq.tokens)
            seq.tokens.append(new_tokens[0])
            return NO_OPS
        if num_computed is not None and seq.speculation is None:
            self._check_computed_window(seq, num_computed)
        growth = self._growth(seq, len(new_tokens))
        return self._append_tokens(seq, new_tokens, num_computed, growth)

    def _append_tokens(
        self, seq: Sequence, new_tokens: list[int], num_computed: int | None, growth: Growth
    ) -> Plan:
        """`append` of checked tokens (at least one) to a resident sequence,
        with `growth` planned for them as of now."""
        ops: list[MemoryOp] = []
        if growth.grows:
            ops.extend(self._reserve(growth.needs, growth.copy_slot))  # may evict: events
        grow(self._groups, self._slots, seq, growth, ops)
        num_before = len(seq.tokens)
        release_from = self._move_progress(seq, num_before, num_computed)
        seq.tokens.extend(new_tokens)
        if seq.speculation is None and self._windowed:  # speculating: released at the commit
            for group in self._groups:
                group.release_out_of_window(seq, release_from)
        if growth.grows and self._events:
            self._deliver_events()
        return tuple(ops) if ops else NO_OPS

    def _growth(self, seq: Sequence, num_new_tokens: int) -> Growth:
        return plan_growth(self._groups, self._slots, seq, num_new_tokens)

    def _has_room_for_next_token(self, seq: Sequence) -> bool:
        """Would one more token go into the sequence's own last page in every
        group, with no page, copy, slot copy or window release? A shortcut
        past `plan_growth` (which would plan no growth). O(groups): a single
        append asks it; a decode step asks `_rows_without_room`, the same
        test over its rows in one loop.

        A group has room when its last page has one reference (the
        sequence's) and, with a window W, the token at n releases no page:
        (n - W + 1) // bs pages are dead, no more than already released."""
        num_tokens = len(seq.tokens)
        if num_tokens % self._block_size == 0 or seq.slot is not None or seq.recompute_hold:
            return False
        tables = seq.tables
        for index, refcounts, window in self._room_checks:
            # past the released pages the last entry is a page, never None
            if refcounts[tables[index][-1]] != 1 or (  # type: ignore[index]
                window is not None
                and (num_tokens - window + 1) // self._block_size > seq.released[index]
            ):
                return False
        return True

    def _rows_without_room(self, seqs: Seq[Sequence]) -> list[int]:
        """The indices of the rows of a decode step that fail
        `_has_room_for_next_token`, the same test written into one loop: a
        call per row cost 39 M instructions on the simulator's 1,000 chat
        requests (1.3 %), more than the test. Raises `SequenceSwapped` for a
        row swapped out. O(len(seqs) x groups). The decode-path tests run
        every step both ways (tests/scheduler/test_scheduler_decode_path.py,
        and the state machines' batch against row-by-row appends)."""
        block_size, checks = self._block_size, self._room_checks
        rows = []
        for row, seq in enumerate(seqs):
            if seq.swapped:
                self._seqs.resident(seq.seq_id)  # raises
            num_tokens = len(seq.tokens)
            if num_tokens % block_size == 0 or seq.slot is not None or seq.recompute_hold:
                rows.append(row)
                continue
            tables, released = seq.tables, seq.released
            for index, refcounts, window in checks:
                # past the released pages the last entry is a page, never None
                if refcounts[tables[index][-1]] != 1 or (  # type: ignore[index]
                    window is not None
                    and (num_tokens - window + 1) // block_size > released[index]
                ):
                    rows.append(row)
                    break
        return rows

    def _check_computed_window(self, seq: Sequence, num_computed: int) -> None:
        """Refuse a computed count whose next token attends to released pages
        (in any page group): computing from there would read pages that are
        gone. O(groups)."""
        if num_computed < len(seq.tokens) and not windows_keep(self._groups, seq, num_computed):
            raise InvalidArgument(
                f"cannot append to {seq.seq_id!r} from {num_computed} computed tokens: "
                "pages its window needs were already released"
            )

    @staticmethod
    def _move_progress(seq: Sequence, num_before: int, num_computed: int | None) -> int:
        """An append's computed count, before its `num_before` tokens: the
        one given (a count below them holds it: see `Sequence`), else every
        token before unless a hold keeps the count. Returns the first
        position still to compute (the window release keeps what it attends
        to). While a speculation is open the hold stays with the transaction."""
        if num_computed is not None:
            seq.num_computed = num_computed
            if seq.speculation is None:
                seq.recompute_hold = num_computed < num_before
        elif not seq.recompute_hold:
            seq.num_computed = num_before
        return seq.num_computed

    def can_append_decode(self, seq_ids: list[Hashable] | tuple[Hashable, ...]) -> bool:
        """Would `append_decode(seq_ids, tokens)` (any valid tokens) succeed
        now? Raises on bad ids like it; changes nothing. O(len(seq_ids))."""
        seqs = self._decode_seqs(seq_ids)
        return self._decode_room(*self._plan_decode(seqs)) is None

    def append_decode(
        self, seq_ids: list[Hashable] | tuple[Hashable, ...], tokens: Iterable[int]
    ) -> Plan:
        """One decode step of many sequences: `append(seq_ids[i], [tokens[i]])`
        for each i, in order, as one call that succeeds whole or raises and
        changes nothing.

        The room check is made for the whole batch before anything changes:
        the sum of each row's own growth as of the call (pages, page and slot
        copies) must be free or reclaimable, else `OutOfBlocks` / `OutOfSlots`.
        That sum can only overstate what the rows take one by one (a sibling's
        copy can leave another sibling the sole owner of its page), so a refusal
        here may be one that row-by-row appends would have got through; a
        caller that needs their exact outcome then appends row by row. Bad
        ids (unknown, swapped, repeated) or tokens raise `InvalidArgument`.
        The plan is the rows' plans in row order. O(len(seq_ids) x groups)
        plus the growing rows' page work.
        """
        seqs = self._decode_seqs(seq_ids)
        checked = decode_tokens(tokens, len(seqs))
        growing, needs, num_slots = self._plan_decode(seqs)
        error = self._decode_room(growing, needs, num_slots)
        if error is not None:
            raise error
        if not growing:  # the common step: every row has room in its own last page
            for seq, token in zip(seqs, checked):
                tokens = seq.tokens
                seq.num_computed = len(tokens)  # no hold: the room check says so
                tokens.append(token)
            return NO_OPS
        ops: list[MemoryOp] = []
        for index, (seq, token) in enumerate(zip(seqs, checked)):
            if index not in growing:
                tokens = seq.tokens
                seq.num_computed = len(tokens)
                tokens.append(token)
                continue
            growth = growing[index]
            if growth.copy_slot or True in growth.copies:
                # A copy planned as of the call: an earlier row's copy or an
                # eviction may have left this row the sole owner since.
                growth = self._growth(seq, 1)
            ops.extend(self._append_tokens(seq, [token], None, growth))
        return tuple(ops)

    def _decode_seqs(self, seq_ids: object) -> list[Sequence]:
        """The resident sequences of `seq_ids`, each once; raises naming a
        bad id."""
        if not isinstance(seq_ids, (list, tuple)):
            raise WrongArgumentType(f"seq_ids must be a list or tuple of ids, got {seq_ids!r:.80}")
        try:
            seqs = list(map(self._seqs.__getitem__, seq_ids))  # the common case, at C speed
        except (KeyError, TypeError):
            seqs = [self._seqs.resident(seq_id) for seq_id in seq_ids]  # raises, naming the id
        # Sequences hash by identity, as CPython hashes a pointer: rotated so
        # that the zero low bits of aligned addresses do not crowd the set's
        # slots (a set of raw `id`s collided every few rows).
        if len(set(seqs)) != len(seqs):
            raise InvalidArgument(f"seq_ids repeats a sequence: {seq_ids!r:.120}")
        return seqs

    def _plan_decode(self, seqs: list[Sequence]) -> tuple[dict[int, Growth], list[int], int]:
        """The growth of each row of a decode step that needs more than a
        slot in its own last page (`growing`, by row index), and the pages
        of each group and the slots they take at most. Pure; raises
        `SequenceSwapped` for a row swapped out."""
        growing: dict[int, Growth] = {}
        needs = [0] * len(self._groups)
        num_slots = 0
        for index in self._rows_without_room(seqs):
            growth = growing[index] = self._growth(seqs[index], 1)
            for group, need in enumerate(growth.needs):
                needs[group] += need
            num_slots += growth.copy_slot
        return growing, needs, num_slots

    def _decode_room(
        self, growing: dict[int, Growth], needs: list[int], num_slots: int
    ) -> OutOfBlocks | OutOfSlots | None:
        """The error a decode step would raise for lack of room, or None when
        it fits. Pure."""
        if not growing:
            return None
        return self._room_error("a decode step needs up to", needs, num_slots)

    # ------------------------------------------------------------------- fork

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> Plan:
        """Start `new_seq_id` as a copy of `seq_id`, sharing pages and slot.

        Fork once every reserved token of `seq_id` is computed; the first
        write of either sequence copies what it shares. O(pages x groups).
        """
        seq = self._seqs.idle(seq_id)
        self._seqs.check_new_id(new_seq_id)
        tables = [group.share(seq) for group in self._groups]
        if seq.slot is not None:
            self._slot_pool.incref(seq.slot)
        if seq.locked_node is not None:
            self._cache.lock(seq.locked_node)
        self._seqs[new_seq_id] = Sequence(
            new_seq_id,
            seq.namespace,
            list(seq.tokens),
            tables,
            seq.released[:],
            seq.slot,
            seq.locked_node,
            anchored=seq.anchored,
            num_borrowed=seq.num_borrowed,  # the same lock holds them
            packed=seq.packed,
            num_computed=seq.num_computed,
            recompute_hold=seq.recompute_hold,
            retention=seq.retention,
            forked=True,
        )
        seq.forked = True
        return NO_OPS

    # --------------------------------------------------------------- truncate

    def can_truncate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Would `truncate(seq_id, num_tokens)` succeed now? Changes nothing.

        Bad arguments still raise, as in `truncate`.
        """
        seq = self._seqs.idle(seq_id)
        num_tokens = self._check_truncate_target(seq, num_tokens)
        if num_tokens == len(seq.tokens):
            return True
        if not windows_keep(self._groups, seq, num_tokens):
            return False
        if seq.slot is None:
            return True
        if num_tokens == 0:
            return (
                self._slot_pool.refcount(seq.slot) == 1
                or self._slot_room_error("need", 1) is None
            )
        return self._snapshot_at(seq, num_tokens) is not None

    def truncate(self, seq_id: Hashable, num_tokens: int) -> Plan:
        """Roll the sequence back to its first `num_tokens` tokens.

        Pages past the new end are released. Recurrent state cannot be cut:
        a hybrid sequence takes the trie's snapshot at exactly `num_tokens`
        (shared, CoW) and `NoSnapshot` is raised when there is none. With a
        sliding window, rolling back past released pages is refused.
        """
        seq = self._seqs.idle(seq_id)
        num_tokens = self._check_truncate_target(seq, num_tokens)
        if num_tokens == len(seq.tokens):
            return NO_OPS
        if not windows_keep(self._groups, seq, num_tokens):
            raise InvalidArgument(
                f"cannot truncate {seq_id!r} to {num_tokens} tokens: pages its "
                "window needs were already released"
            )
        ops, new_slot = self._rollback_slot(seq, num_tokens)
        keep = -(-num_tokens // self._block_size)
        # A borrowed page the new end falls inside will be written: own it.
        num_borrowed = min(seq.num_borrowed, num_tokens // self._block_size)
        for group in self._groups:
            group.truncate(seq, keep, num_borrowed)
        seq.num_borrowed = num_borrowed
        del seq.tokens[num_tokens:]
        if len(seq.packed) > num_tokens * TOKEN_BYTES:
            seq.packed = seq.packed[: num_tokens * TOKEN_BYTES]
        if seq.locked_node is not None and num_tokens < seq.locked_node.end:
            seq.anchored = False  # new tokens may differ from the node's
        if seq.num_computed > num_tokens:
            seq.num_computed = num_tokens
        if new_slot is not None:
            old_slot, seq.slot = seq.slot, new_slot
            if old_slot is not None:
                self._slot_pool.release(old_slot)
        if self._events:
            self._deliver_events()
        return ops

    def _check_truncate_target(self, seq: Sequence, num_tokens: object) -> int:
        checked = check_count("num_tokens", num_tokens)
        if checked > len(seq.tokens):
            raise InvalidArgument(
                f"cannot truncate {seq.seq_id!r} to {checked} tokens: "
                f"it has {len(seq.tokens)}"
            )
        return checked

    def _snapshot_at(self, seq: Sequence, num_tokens: int) -> TrieNode | None:
        if self._trie is None:
            return None
        return self._trie.find_snapshot(seq.namespace, seq.tokens[:num_tokens])

    def _rollback_slot(self, seq: Sequence, num_tokens: int) -> tuple[Plan, int | None]:
        """The slot holding the state at `num_tokens` (a new reference) and ops."""
        if seq.slot is None:
            return NO_OPS, None
        slots = self._slot_pool
        if num_tokens == 0:
            if slots.refcount(seq.slot) == 1:
                slots.incref(seq.slot)  # the caller drops the old reference
                return (ZeroSlot(seq.slot),), seq.slot
            evicted = self._reserve([0] * len(self._groups), 1)
            slot = slots.take_one()
            return (*evicted, ZeroSlot(slot)), slot
        node = self._snapshot_at(seq, num_tokens)
        if node is None or node.slot is None:
            raise NoSnapshot(
                f"cannot roll {seq.seq_id!r} back to {num_tokens} tokens: no recurrent "
                "snapshot exists there (cache_prefix that point before speculating)"
            )
        slots.incref(node.slot)
        return NO_OPS, node.slot

    # ------------------------------------------------------------ speculation

    def can_speculate(
        self,
        drafts: Mapping[Hashable, Iterable[int]],
        num_computed: Mapping[Hashable, int] | None = None,
    ) -> bool:
        """Would `begin_speculation(drafts, num_computed)` succeed now?
        Changes nothing; bad arguments raise as there."""
        plan = self._speculation.plan_begin(drafts, num_computed)
        return self._room_error("need", plan.needs, plan.num_slots) is None

    def recompute_from(self, seq_id: Hashable) -> int | None:
        """The position a restored checkpoint is computed again from, while
        the window keeps what it attends to (None: no such hold)."""
        seq = self._seqs.live(seq_id)
        return seq.num_computed if seq.recompute_hold else None

    def begin_speculation(
        self,
        drafts: Mapping[Hashable, Iterable[int]],
        num_computed: Mapping[Hashable, int] | None = None,
    ) -> Plan:
        """Open a speculation transaction for every sequence in `drafts`
        (seq_id -> draft token ids, possibly none) and reserve pages for the
        drafts, all at once or not at all.

        The drafts (and whatever `append` adds before the commit) are the
        speculative tail: never inserted into the prefix trie. A hybrid
        sequence's slot becomes a copy (`CopySlot`) of its current state and
        the old slot is kept as the checkpoint (a shared slot, after a fork,
        is copied into a checkpoint of its own: two slots). While a transaction is open,
        `fork`, `truncate`, `cache_prefix` and `swap_out` raise
        `SpeculationInFlight` and `free` aborts it first.

        `num_computed` (seq_id -> count) says where the checkpoint stands:
        the tokens computed at begin, which a commit keeping less than the
        whole tail makes the caller compute again. Default: a hybrid
        sequence's hold (`recompute_from`) or all its tokens; none for the
        others. With a sliding window, no page is released until the commit;
        after a commit keeping less than the tail, the window keeps the pages
        that position attends to until `append` is given a larger count.
        Raises `InvalidArgument` when those pages were already released, and
        `OutOfBlocks` / `OutOfSlots` (nothing changed) when memory is short
        after eviction. O(sequences + draft pages).
        """
        plan = self._speculation.plan_begin(drafts, num_computed)
        evicted = self._reserve(plan.needs, plan.num_slots)
        ops = (*evicted, *self._speculation.begin(plan))
        if self._events:
            self._deliver_events()
        return ops

    def commit_speculation(self, accepted: Mapping[Hashable, int]) -> frozenset[Hashable]:
        """Close the transactions of the sequences in `accepted` (seq_id ->
        drafts kept): each keeps its tokens up to `start + accepted` and
        releases the pages past them, all at once or not at all.

        A hybrid sequence keeping every speculative token keeps its working
        slot (the state after them); one keeping fewer gets its checkpoint
        back (the state at begin): returned in the set of *restored*
        sequences, whose tokens from that state on must be computed again.
        Raises `InvalidArgument` (nothing changed) for a sequence without a
        transaction or a count past its speculative tail. O(sequences +
        released pages).
        """
        return self._speculation.commit(self._speculation.plan_commit(accepted))

    def abort_speculation(self, seq_ids: Iterable[Hashable]) -> frozenset[Hashable]:
        """Close the transactions of `seq_ids` keeping no draft (a hybrid
        sequence gets its checkpoint back: returned, as by the commit). All
        or nothing, as the commit."""
        if isinstance(seq_ids, (str, bytes)):
            raise WrongArgumentType(f"seq_ids must be a collection of ids, got {seq_ids!r:.80}")
        return self.commit_speculation(dict.fromkeys(seq_ids, 0))

    def shorten_speculation(self, kept: Mapping[Hashable, int]) -> None:
        """Drop the speculative tokens of each sequence in `kept` (seq_id ->
        speculative tokens kept) past `start + kept`, releasing their pages;
        the transactions stay open and the slots are untouched (the caller
        undoes an `append` whose forward never wrote anything). All or
        nothing: raises `InvalidArgument` like the commit, changing nothing.
        O(sequences + released pages)."""
        self._speculation.shorten(self._speculation.plan_commit(kept))

    def speculation_start(self, seq_id: Hashable) -> int | None:
        """The token count at `begin_speculation` (None: no transaction open)."""
        spec = self._seqs.live(seq_id).speculation
        return None if spec is None else spec.start

    # ----------------------------------------------------------- cache/free

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> Plan:
        """Snapshot the sequence's first `num_tokens` tokens into the trie.

        Call it once those tokens are computed (None: all of them); for a
        hybrid model the sequence's slot must hold the state at exactly that
        point (the end of a prefill chunk). Pages are shared; the slot is
        copied (`CopySlot`). A no-op without a prefix cache. Raises
        `OutOfSlots` when no slot can be had for the snapshot.

        The snapshot is a *checkpoint* (`TrieNode.checkpoint`) unless it
        is at the allocation's branch point: the sequence goes on, so the
        next snapshot on its path serves its session better (the one `free`
        leaves, which a next turn continues from). Under slot pressure
        checkpoints are dropped first within a retention priority, and a
        checkpoint only takes the slot of another checkpoint or of a lower
        priority's snapshot: when no slot is free and eviction would first
        drop a snapshot a sequence of its priority (or a higher one) ended
        at, this raises `OutOfSlots` (nothing changed). `design/prefix_trie.md`
        has the measurements.
        """
        seq = self._seqs.idle(seq_id)
        num_tokens = self._computed_count(seq, num_tokens)
        trie = self._trie
        if trie is None or num_tokens == 0:
            return NO_OPS
        snapshot = None
        evicted = NO_OPS
        checkpoint = num_tokens != seq.branch_point
        if seq.slot is not None:
            slots = self._slot_pool
            if checkpoint and not slots.num_free and not trie.can_free_slots(
                1, checkpoint_retention=seq.retention
            ):
                raise OutOfSlots(
                    f"checkpoint at {num_tokens}: no slot free of {slots.num_items} and "
                    "eviction would first drop a snapshot a sequence of its priority ended at"
                )
            evicted = self._reserve([0] * len(self._groups), 1)
            snapshot = self._slot_pool.take_one()
        start = self._insert_start(seq, num_tokens)
        # From the sequence's lock (or with none) the lock moves to the node
        # the insert returns: the trie locks it before its LRU update, which
        # then leaves a new leaf out of the LRU list instead of in and out.
        moves = start is not None or seq.locked_node is None
        node, took_slot = self._insert(
            trie, seq, num_tokens, snapshot, start, lock=moves, checkpoint=checkpoint
        )
        ops = evicted
        if snapshot is not None and seq.slot is not None:
            self._slot_pool.release(snapshot)  # the trie holds its own reference
            if took_slot:
                ops = (*evicted, CopySlot(seq.slot, snapshot))
        self._move_lock(seq, node, locked=moves)
        if self._events:
            self._deliver_events()
        return ops

    def _insert(
        self,
        trie: PrefixTrie,
        seq: Sequence,
        num_tokens: int,
        slot: int | None,
        start: TrieNode | None,
        *,
        lock: bool = False,
        checkpoint: bool = False,
    ) -> tuple[TrieNode | None, bool]:
        """Store the sequence's first `num_tokens` tokens (state `slot`) in the
        trie from `start` (`_insert_start`); the caller then drops the
        sequence's lock or moves it to the returned node (`lock`: the trie
        locks that node first, as `PrefixTrie.insert`'s `lock`;
        `checkpoint` as `PrefixTrie.insert`'s). From the
        sequence's own unshared leaf the trie extends that leaf
        (`PrefixTrie.extend`: what the insert and that lock change give, at
        once). Returns `insert`'s (node, took_slot)."""
        if start is not None and trie.can_extend(start, num_tokens, slot):  # reads no copy
            return trie.extend(
                start, seq.tokens, num_tokens, seq.tables, seq.packed, lock=lock,
                retention=seq.retention,
            ), False
        tokens = seq.tokens if num_tokens == len(seq.tokens) else seq.tokens[:num_tokens]
        return trie.insert(
            seq.namespace, tokens, seq.tables, slot, start, seq.packed, lock=lock,
            retention=seq.retention, checkpoint=checkpoint,
        )

    @staticmethod
    def _insert_start(seq: Sequence, num_tokens: int) -> TrieNode | None:
        """The node a trie insert of the sequence's first `num_tokens` tokens
        may continue from (its anchored lock, which spells tokens[:end]), or
        None to walk from the root. Saves comparing the cached prefix again
        at every chunk end."""
        node = seq.locked_node
        return node if seq.anchored and node is not None and node.end <= num_tokens else None

    def _move_lock(self, seq: Sequence, node: TrieNode | None, *, locked: bool = False) -> None:
        """Lock `node` (on the sequence's own path) instead of the current
        lock, unless the current one is deeper on that same path. `locked`:
        the insert that returned `node` locked it already (it continued from
        the current lock, or there is none: `node` is never shallower)."""
        old = seq.locked_node
        if node is None or (old is not None and seq.anchored and old.end > node.end):
            return
        trie = self._cache
        if not locked:
            trie.lock(node)
        if old is not None:
            self._own_borrowed(seq)
            trie.unlock(old)
        seq.locked_node = node
        seq.anchored = True

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan:
        """End the sequence; its first `num_computed` tokens go into the trie.

        None means every token was computed. The slot (state after the last
        computed token) is handed to the trie with no copy; tokens already
        cached are not stored twice. A sequence that forked or was forked
        (a prompt and its samples) leaves a checkpoint there
        (`TrieNode.checkpoint`, dropped first under slot pressure): a next
        turn continues at most one of the samples. Never fails for a live id. A swapped-out
        sequence just gives its host memory back. An open speculation is
        aborted first (`num_computed` counts from the tokens before it).
        """
        seq = self._seqs.live(seq_id)
        spec = seq.speculation
        if spec is not None:
            self._speculation.check_free_count(seq, spec, num_computed)
            self._speculation.end(seq, spec, 0)  # drafts never reach the trie
        num_computed = self._computed_count(seq, num_computed)
        del self._seqs[seq_id]
        if seq.swapped:
            self._swap.release_host_copy(seq)
            return NO_OPS
        trie = self._trie
        if trie is not None:
            if num_computed:
                start = self._insert_start(seq, num_computed)
                self._insert(trie, seq, num_computed, seq.slot, start, checkpoint=seq.forked)
            if seq.locked_node is not None:
                trie.unlock(seq.locked_node)
        for group in self._groups:
            group.release(seq)
        if seq.slot is not None:
            self._slot_pool.release(seq.slot)
        if self._events:
            self._deliver_events()
        return NO_OPS

    def _own_borrowed(self, seq: Sequence) -> None:
        """Take the sequence's own references to its borrowed pages (before
        its lock moves or goes). O(borrowed pages x groups)."""
        for group in self._groups:
            group.own_borrowed(seq)
        seq.num_borrowed = 0

    def _computed_count(self, seq: Sequence, num_computed: object) -> int:
        if num_computed is None:
            return len(seq.tokens)
        checked = check_count("num_computed", num_computed)
        if checked > len(seq.tokens):
            raise InvalidArgument(f"{seq.seq_id!r} has {len(seq.tokens)} tokens, not {checked}")
        return checked

    # ------------------------------------------------------------------ swap

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._seqs.live(seq_id).swapped

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Is there host memory to swap the sequence out? Changes nothing."""
        return self._swap.can_swap_out(self._seqs.idle(seq_id))

    def swap_out(self, seq_id: Hashable) -> Plan:
        """Copy the sequence's pages (and slot) to host memory and release them.

        The sequence stays live but frozen until `swap_in`; it leaves the trie
        alone (its lock is dropped). Raises `OutOfHostMemory`, changing
        nothing, when host memory is short. O(pages).
        """
        seq = self._seqs.idle(seq_id)
        if not self._swap.can_swap_out(seq):
            raise OutOfHostMemory(f"not enough host pages or slots to swap {seq_id!r} out")
        self._own_borrowed(seq)  # so that moving releases every page alike
        ops = self._swap.swap_out(seq)
        if seq.locked_node is not None:
            self._cache.unlock(seq.locked_node)
            seq.locked_node = None
            seq.anchored = False
        return tuple(ops)

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Are there device pages (and a slot) to swap it back in? Changes nothing."""
        needs, num_slots = self._swap.swap_in_needs(self._seqs.swapped_out(seq_id))
        return self._room_error("need", needs, num_slots) is None

    def swap_in(self, seq_id: Hashable) -> Plan:
        """Bring a swapped-out sequence back to fresh device pages (and slot).

        May evict cache entries; raises `OutOfBlocks` / `OutOfSlots`,
        changing nothing, when device memory is short. O(pages).
        """
        seq = self._seqs.swapped_out(seq_id)
        evicted = self._reserve(*self._swap.swap_in_needs(seq))
        ops = self._swap.swap_in(seq)
        if self._events:
            self._deliver_events()
        return (*evicted, *ops)

    # --------------------------------------------------- the disk tier

    def disk_loads(self, match: PrefixMatch) -> tuple[list[list[int]], list[int]]:
        """The disk pages of each group and disk slots that allocating with
        `match` (a `find_prefix` result) reads: a storage verifies or reads
        them ahead first. Pure."""
        if not match.loads:
            return [[] for _ in self._groups], []
        return self._tiered.disk_loads(match)

    def forget_disk_pages(self, group: int, pages: Seq[int]) -> None:
        """Drop the cached prefixes whose disk pages of `group` include any of
        `pages` (their records turned out unreadable): no hit serves them
        again. Any `find_prefix` result from before is stale."""
        self._tiered.forget_disk_pages(self._group_index(group), pages)

    def disk_entries(self) -> list[DiskEntry]:
        """The disk tier's nodes as a restart restores them (`restore_disk`).
        Empty without a disk tier. Pure; O(disk nodes x depth)."""
        if not isinstance(self._trie, TieredTrie) or Tier.DISK not in self._trie.tiers:
            return []
        return self._trie.disk_entries()

    def restore_disk(self, entries: Seq[DiskEntry]) -> list[DiskEntry]:
        """Rebuild the disk tier from `entries` (what `disk_entries` gave
        before a restart, read back by the storage); returns the entries it
        could not take (the storage forgets them). Call it on a new manager
        before any sequence. O(entries x path length)."""
        if self._seqs:
            raise InvalidArgument("restore the disk tier before any sequence is allocated")
        trie = self._tiered
        if Tier.DISK not in trie.tiers:
            raise InvalidArgument("this manager has no disk tier")
        rejected = trie.restore(entries)
        if self._events:
            self._deliver_events()
        return rejected

    def flush_to_disk(self) -> Plan:
        """Move every cached prefix no live sequence uses to the disk tier (a
        graceful shutdown: a restart finds them there), dropping what the
        disk cannot hold; the plan of moves."""
        trie = self._tiered
        if Tier.DISK not in trie.tiers:
            raise InvalidArgument("this manager has no disk tier")
        trie.demote_all()
        if self._events:
            self._deliver_events()
        return tuple(trie.take_ops())

    def disable_tier(self, tier: Tier) -> None:
        """Stop using the prefix cache's `tier` (host or disk: its storage
        failed, e.g. the disk is full): its prefixes are dropped and nothing
        goes there again. Any `find_prefix` result from before is stale."""
        if tier == Tier.DEVICE:
            raise InvalidArgument("the device tier cannot be disabled")
        self._tiered.disable(tier)

    # ---------------------------------------------------------------- pins

    def pin(self, pin_id: Hashable, tokens: Iterable[int], namespace: Hashable = None) -> Plan:
        """Keep the cached prefix of `tokens` (the whole node its hit ends
        in) from eviction and demotion until `unpin(pin_id)`: a system
        prompt or tool list that many requests share. A demoted prefix is
        loaded back first (the plan). Nothing cached: nothing pinned (and
        no plan). Raises `DuplicateSequence` for a pin id in use,
        `OutOfBlocks` / `OutOfSlots` when the load finds no room (nothing
        changed). O(path)."""
        check_hashable("pin_id", pin_id)
        if pin_id in self._pins:
            raise DuplicateSequence(f"pin {pin_id!r} is already held")
        checked, packed = self._checked_prompt(tokens, namespace, None)
        trie = self._cache
        match = trie.match(namespace, checked, len(checked), packed)
        if not match.num_tokens:
            return NO_OPS
        ops: list[MemoryOp] = []
        if match.loads:
            match = self._load_hit(namespace, checked, packed, match, [0] * len(self._groups), ops)
        node = match.path[-1]
        trie.lock(node)
        self._pins[pin_id] = node
        if self._events:
            self._deliver_events()
        return tuple(ops)

    def unpin(self, pin_id: Hashable) -> None:
        """Let the prefix `pin(pin_id, ...)` held be evicted again."""
        try:
            node = self._pins.pop(pin_id)
        except (KeyError, TypeError):
            raise UnknownSequence(f"no pin {pin_id!r}") from None
        self._cache.unlock(node)
        if self._events:
            self._deliver_events()

    def pinned(self) -> dict[Hashable, int]:
        """Each pin's id and the tokens it keeps cached. O(pins)."""
        return {pin_id: node.end for pin_id, node in self._pins.items()}

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix no live sequence is using."""
        if self._trie is not None:
            self._trie.reset()
            self._deliver_events()

    def take_listener_errors(self) -> list[tuple[str, BaseException]]:
        """The (event, exception) of every listener call that raised since the
        last call, oldest first, and forget them.

        A listener runs once the call that cached or evicted has finished and
        the state is consistent; what it raises cannot change that call's
        outcome (a `free` of a live id still succeeds), so it is kept here
        for the owner of the listener instead of being raised into the
        scheduler's bookkeeping.
        """
        errors, self._listener_errors = self._listener_errors, []
        return errors

    def _deliver_events(self) -> None:
        self._listener_errors.extend(self._cache.deliver_events())

    @property
    def _cache(self) -> PrefixTrie:
        """The prefix trie, where a path runs only with one (a hit, a lock, an
        event, an eviction)."""
        if self._trie is None:
            raise IntegrityError("a manager without a prefix cache was asked for it")
        return self._trie

    @property
    def _tiered(self) -> TieredTrie:
        """The tiered prefix trie, where a path runs only with one (a hit in
        a colder tier)."""
        if not isinstance(self._trie, TieredTrie):
            raise IntegrityError("a manager without cache tiers was asked for them")
        return self._trie

    @property
    def _slot_pool(self) -> RefCountedPool:
        """The slot pool, where a path runs only with one (a sequence's slot)."""
        if self._slots is None:
            raise IntegrityError("a manager without recurrent slots was asked for one")
        return self._slots

    # ----------------------------------------------------------- room, match

    def _fits(self, needs: Seq[int], num_slots: int) -> bool:
        """Are `needs[i]` pages free in group i and `num_slots` slots free
        (no eviction)? O(groups)."""
        for group in self._groups:
            if needs[group.index] > group.pages.num_free:
                return False
        return self._slots is None or num_slots <= self._slots.num_free

    def _room_error(
        self, what: str, needs: Seq[int], num_slots: int
    ) -> OutOfBlocks | OutOfSlots | None:
        """The error of a call that `what` ("need", ...) `needs[i]` pages of
        group i and `num_slots` slots, when eviction cannot free them (None:
        it fits). Checked in the order group 0, the slots, the other groups
        (the slots are group 0's): the first that cannot. Pure."""
        trie = self._trie
        for group in self._groups:
            need = needs[group.index]
            short = need - group.pages.num_free  # reclaimable by evicting the trie?
            if short > 0 and (trie is None or not trie.can_free_pages(short, group.index)):
                return group.room_error(what, need, len(self._groups))
            if group.index == 0 and self._slots is not None:
                error = self._slot_room_error(what, num_slots)
                if error is not None:
                    return error
        return None

    def _slot_room_error(self, what: str, num_slots: int) -> OutOfSlots | None:
        slots = self._slots
        if slots is None or num_slots == 0:
            return None
        short = num_slots - slots.num_free
        if short <= 0 or (self._trie is not None and self._trie.can_free_slots(short)):
            return None
        return OutOfSlots(
            f"{what} {num_slots} slots: {slots.num_free} free of {slots.num_items}, "
            "not enough reclaimable from the prefix cache"
        )

    def _reserve(self, needs: Seq[int], num_slots: int) -> Plan:
        """Make `needs[i]` pages of group i and `num_slots` slots free,
        evicting LRU cache entries if needed; raise (changing nothing) when
        that cannot work. Returns the moves of what eviction demoted to a
        colder tier (first in the caller's plan: they read device pages
        before anything reuses them)."""
        for group in self._groups:  # `_fits`, inline: this runs at every allocation
            if needs[group.index] > group.pages.num_free:
                break
        else:
            if self._slots is None or num_slots <= self._slots.num_free:
                return NO_OPS  # the common case: nothing to evict
        error = self._room_error("need", needs, num_slots)
        if error is not None:
            raise error
        trie = self._cache  # nothing would be reclaimable without it
        slots = self._slots
        for group in self._groups:
            # Eviction only frees: a group that fits stays so as others evict.
            need = needs[group.index]
            if need > group.pages.num_free and not trie.evict_pages(need, group.index):
                raise IntegrityError("eviction freed less than its plan promised")
            if group.index == 0 and slots is not None and num_slots > slots.num_free \
                    and not trie.evict_slots(num_slots):
                raise IntegrityError("eviction freed fewer slots than its plan promised")
        if isinstance(trie, TieredTrie):
            return tuple(trie.take_ops())
        return NO_OPS

    def _match(
        self, namespace: Hashable, tokens: list[int], packed: bytes, limit: int | None = None
    ) -> PrefixMatch:
        if self._trie is None:
            return _NO_MATCH
        cap = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
        return self._trie.match(namespace, tokens, cap, packed)

    def _group_index(self, group: object) -> int:
        """The position of page group number `group` (as its ops carry it)."""
        first = self._first_group
        if type(group) is int and first <= group < first + len(self._groups):
            return group - first
        checked = check_int("group", group, first, first + len(self._groups) - 1)
        return checked - first

    # -------------------------------------------------------------- checking

    def check_no_leaks(self) -> None:
        """For the end of a run, when every sequence has ended: nothing but
        the prefix cache holds a page or a slot (device or host, swap space
        included), and dropping the device prefix cache
        (`reset_prefix_cache`) frees every page and slot; then
        `check_integrity`. Raises `MemoryLeak` naming what is held. Drops
        the device prefix cache. O(pages + cached prefixes)."""
        problems = self._held_beyond_the_cache()
        self.reset_prefix_cache()
        for usage in self.group_usage():
            if usage.num_free_pages != usage.num_pages:
                problems.append(f"group {usage.group}: {usage.num_pages - usage.num_free_pages} "
                                "pages not free after dropping the prefix cache")
        num_slots = self.config.num_slots
        if self.num_free_slots != num_slots:
            problems.append(f"{num_slots - self.num_free_slots} slots not free after dropping "
                            "the prefix cache")
        self.check_integrity()
        if problems:
            raise MemoryLeak("; ".join(problems))

    def _held_beyond_the_cache(self) -> list[str]:
        """What holds memory besides the prefix cache: live sequences, pages
        and slots the trie does not account for, host pages and slots."""
        problems = []
        if self.num_sequences:
            problems.append(f"{self.num_sequences} sequences still live: {self.sequence_ids()[:5]}")
        for usage in self.group_usage():
            used = usage.num_pages - usage.num_free_pages
            if used != usage.num_cached_pages:
                problems.append(f"group {usage.group}: {used} pages in use but the prefix "
                                f"cache holds {usage.num_cached_pages}")
            if usage.num_free_host_pages != usage.num_host_pages:
                problems.append(f"group {usage.group}: "
                                f"{usage.num_host_pages - usage.num_free_host_pages} host "
                                "pages still in use")
        num_used = self.config.num_slots - self.num_free_slots
        num_cached = self.stats.num_trie_slots
        if num_used != num_cached:
            problems.append(f"{num_used} slots in use but the prefix cache holds {num_cached}")
        num_host_slots = self.config.num_host_slots
        if self.num_free_host_slots != num_host_slots:
            problems.append(f"{num_host_slots - self.num_free_host_slots} host slots still in use")
        return problems

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if any invariant is broken
        (`blockmgr.checks` lists them: refcounts, free lists, tables,
        borrowed pages, speculation, the trie's own). O(state size)."""
        self._checks.check(self._trie, self._pins)

    def debug_state(self) -> tuple[object, ...]:
        """Everything observable, as plain values: equal before and after any
        call that failed. For tests; O(state size)."""
        counters = (
            self._num_queries,
            self._num_hits,
            self._num_query_tokens,
            self._num_hit_tokens,
        )
        return self._checks.debug_state(self._trie, self._pins, counters)


#: The match of a manager without a prefix cache (never mutated: no hit).
_NO_MATCH = PrefixMatch()
