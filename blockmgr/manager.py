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
from itertools import chain

from blockmgr.config import BlockManagerConfig
from blockmgr.errors import (
    DuplicateSequence,
    IntegrityError,
    InvalidArgument,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
    SequenceSwapped,
    SpeculationInFlight,
    UnknownSequence,
    WrongArgumentType,
)
from blockmgr.ops import (
    NO_OPS,
    CopyBlock,
    CopySlot,
    MemoryOp,
    ZeroSlot,
)
from blockmgr.page_group import PageGroup
from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import (
    TOKEN_BYTES,
    PrefixCacheListener,
    PrefixMatch,
    PrefixTrie,
    pack_tokens,
)
from blockmgr.sequence import Allocation, DecodePlan, Sequence
from blockmgr.speculation import SpeculationTransactions
from blockmgr.stats import PrefixCacheStats
from blockmgr.swap import HostSwap
from blockmgr.validation import (
    MAX_TOKEN_ID,
    check_count,
    check_int,
    check_hashable,
    decode_tokens,
    packed_prompt,
    prompt_list,
    token_list,
)

Plan = tuple[MemoryOp, ...]


class BlockManager:
    """Bookkeeping of KV pages, recurrent slots and cached prefixes.

    Not thread-safe: one scheduler drives it. Costs are per call and do not
    depend on the number of live sequences; page work is O(pages touched),
    trie work O(matched tokens + depth).
    """

    def __init__(
        self,
        config: BlockManagerConfig,
        listener: PrefixCacheListener | None = None,
        *,
        group: int = 0,
        more_groups: tuple[BlockManagerConfig, ...] = (),
    ) -> None:
        """`group`: the layer group this manager keeps (stamped on its page
        ops, see `blockmgr.ops`); 0 when it is a model's only manager.
        `more_groups`: the configs of further page groups (groups `group + 1`
        on) kept in the same trie and sequence records (`blockmgr.page_group`;
        their block size and prefix cache setting are this config's)."""
        if not isinstance(config, BlockManagerConfig):
            raise InvalidArgument(f"config must be a BlockManagerConfig, got {config!r}")
        self.config = config
        self._more = tuple(
            PageGroup.build(index, more) for index, more in enumerate(more_groups, group + 1)
        )
        self._group = group
        self._block_size = config.block_size
        self._window = config.sliding_window
        self._pages = RefCountedPool(config.num_blocks)
        self._slots = RefCountedPool(config.num_slots) if config.is_hybrid else None
        self._host_pages = RefCountedPool(config.num_host_blocks)
        self._host_slots = RefCountedPool(config.num_host_slots)
        self._speculation = SpeculationTransactions(
            self._pages, self._slots, self._more, config.block_size,
            idle=self._idle, get=self._get, growth=self._growth,
            make_writable=self._make_writable, window_keeps=self._window_keeps,
        )
        self._swap = HostSwap(
            self._pages, self._slots, self._host_pages, self._host_slots, self._more, group
        )
        self._trie = (
            PrefixTrie(
                config.block_size, self._pages, self._slots, listener, config.sliding_window,
                tuple((more.pages, more.window) for more in self._more),
            )
            if config.enable_prefix_cache
            else None
        )
        self._seqs: dict[Hashable, Sequence] = {}
        # Listener calls queued by the trie, delivered when a call is done.
        self._events: list[tuple] = self._trie.events if self._trie is not None else []
        self._listener_errors: list[tuple[str, BaseException]] = []
        self._num_watermark_blocks = config.num_watermark_blocks
        self._num_queries = 0
        self._num_hits = 0
        self._num_query_tokens = 0
        self._num_hit_tokens = 0

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
    def num_usable_blocks(self) -> int:
        """Pages one sequence may hold in an empty pool (past the watermark)."""
        return self.config.num_blocks - self.config.num_watermark_blocks

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def sequence_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def block_table(self, seq_id: Hashable, group: int | None = None) -> list[int | None]:
        """A copy of the sequence's page table (None: released by the window)
        in page group `group` (None: this manager's own group)."""
        seq = self._get(seq_id)
        if group is None:
            return list(seq.block_table)
        first = self._group
        if not (type(group) is int and first <= group <= first + len(self._more)):
            group = check_int("group", group, first, first + len(self._more))  # raises, or numpy
        return list(seq.block_table if group == first else seq.more_tables[group - first - 1])

    @property
    def page_groups(self) -> tuple[PageGroup, ...]:
        """The further page groups kept with this one (read their pools)."""
        return self._more

    def num_cached_blocks_in(self, group: int) -> int:
        """Distinct pages of page group `group` held by the prefix trie."""
        if self._trie is None:
            return 0
        return self._trie.num_pages_held_in(group - self._group)

    def num_evicted_pages_in(self, group: int) -> int:
        if self._trie is None:
            return 0
        return self._trie.num_evicted_pages_in(group - self._group)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id).tokens)

    def tokens(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).tokens)

    def slot(self, seq_id: Hashable) -> int | None:
        return self._get(seq_id).slot

    def namespace(self, seq_id: Hashable) -> Hashable:
        return self._get(seq_id).namespace

    @property
    def num_free_blocks(self) -> int:
        """Pages free right now (pages held only by the trie are not counted)."""
        return self._pages.num_free

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free if self._slots is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        return self._host_pages.num_free

    @property
    def num_free_host_slots(self) -> int:
        return self._host_slots.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Distinct pages held by the prefix trie (some shared with sequences)."""
        return self._trie.num_pages_held if self._trie is not None else 0

    @property
    def usage(self) -> float:
        """Fraction of pages in use by sequences or the trie."""
        return self._pages.num_used / self._pages.num_items

    @property
    def stats(self) -> PrefixCacheStats:
        trie = self._trie
        return PrefixCacheStats(
            num_queries=self._num_queries,
            num_hits=self._num_hits,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evicted_pages=trie.num_evicted_pages if trie else 0,
            num_evicted_nodes=trie.num_evicted_nodes if trie else 0,
            num_trie_nodes=trie.num_nodes if trie else 0,
            num_trie_pages=trie.num_pages_held if trie else 0,
            num_trie_slots=trie.num_slots_held if trie else 0,
        )

    # --------------------------------------------------------------- allocate

    def cached_prefix_length(self, tokens: Iterable[int], namespace: Hashable = None) -> int:
        """How many tokens `allocate` would reuse right now. Changes nothing.

        For admission control that counts only new tokens against a budget.
        O(matched tokens + depth).
        """
        tokens, packed = packed_prompt(tokens, "tokens")
        check_hashable("namespace", namespace)
        return self._match(namespace, tokens, packed).num_tokens

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
        For a cache-aware router's view (`scheduler.kv_events`). Pure;
        O(sum of the paths' lengths)."""
        return [] if self._trie is None else self._trie.cached_paths()

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
        tokens, packed = self._checked_prompt(tokens, namespace, packed)
        if limit is not None:
            limit = check_count("limit", limit)
        return self._match(namespace, tokens, packed, limit)

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
        tokens, packed = self._checked_prompt(tokens, namespace, packed)
        if match is None:
            match = self._match(namespace, tokens, packed)
        num_pages = self._num_new_pages(len(tokens), match.num_tokens) + self._watermark()
        more = self._more_needs(num_pages - self._watermark()) if self._more else None
        if num_pages <= self._pages.num_free and (
            self._slots is None or self._slots.num_free
        ) and (more is None or self._more_fit(more)):
            return True  # the common case: no eviction, so nothing to protect
        return self._with_match_held(match, self._can_reserve, num_pages, 1, more)

    def _checked_prompt(
        self, tokens: Iterable[int], namespace: Hashable, packed: bytes | None
    ) -> tuple[list[int], bytes]:
        """The prompt as a checked list and its packed bytes (trusted when
        `packed` is given: the caller checked both)."""
        if packed is not None:
            return tokens, packed
        check_hashable("namespace", namespace)
        if self._trie is None:  # nothing to match against: no packing
            return prompt_list(tokens, "tokens"), b""
        return packed_prompt(tokens, "tokens")

    def allocate(
        self,
        seq_id: Hashable,
        tokens: Iterable[int],
        namespace: Hashable = None,
        *,
        match: PrefixMatch | None = None,
        packed: bytes | None = None,
    ) -> Allocation:
        """Reserve pages (and a slot) for a new sequence's prompt.

        Shares the longest usable cached prefix (or `match`, a `find_prefix`
        result of this manager with no call in between; `packed` as in
        `find_prefix`, and then the manager keeps that `tokens` list as the
        sequence's own: pass one nothing else holds); `num_cached_tokens`
        of the result says how many tokens need no compute (at most len - 1).
        Evicts least recently used cache entries when memory is short; raises
        `OutOfBlocks` / `OutOfSlots` (changing nothing) when that is not
        enough, `DuplicateSequence` for a live id. O(prompt pages + matched
        tokens).
        """
        self._check_new_id(seq_id)
        tokens, packed = self._checked_prompt(tokens, namespace, packed)
        if match is None:
            match = self._match(namespace, tokens, packed)
        num_tokens, num_cached = len(tokens), match.num_tokens
        num_pages = self._num_new_pages(num_tokens, num_cached)
        self._hold_match(match)
        try:
            self._reserve(
                num_pages + self._num_watermark_blocks, 1,
                self._more_needs(num_pages) if self._more else None,
            )
        except (OutOfBlocks, OutOfSlots):
            self._release_match(match)
            raise
        if match.path:
            self._trie.touch(match.path)
        ops: list[MemoryOp] = []
        table = self._own_matched_pages(match, ops)
        table += self._pages.take(-(-num_tokens // self._block_size) - len(table))
        slot = self._new_sequence_slot(match.slot, ops) if self._slots is not None else None
        node = match.node  # ends inside the matched prefix: an anchor
        self._seqs[seq_id] = seq = Sequence(
            seq_id,
            namespace,
            tokens,
            table,
            slot,
            node,
            match.num_released,
            anchored=node is not None,
            num_borrowed=match.num_locked_pages,
            packed=packed,
        )
        if self._more:
            seq.more_tables = [
                more.new_table(match, index, num_tokens, ops) for index, more in enumerate(self._more)
            ]
            seq.more_released = list(match.more_released or [0] * len(self._more))
        self._count_query(num_tokens, num_cached)
        if self._events:
            self._deliver_events()
        return Allocation(seq_id, table[:], slot, tuple(ops), num_cached, match.branch_point)

    def _hold_match(self, match: PrefixMatch) -> None:
        """Keep the matched pages alive through eviction: a lock on the nodes
        wholly inside the hit (it keeps their pages: those are borrowed),
        and the sequence's own references to the pages past them (a node the
        hit ends inside stays evictable past the hit)."""
        if match.node is not None:
            self._trie.lock(match.node)
        pages = match.pages
        first_owned = max(match.num_locked_pages, match.num_released)
        if len(pages) > first_owned:
            self._pages.incref_all(pages[first_owned:])
        if match.more_pages is not None:
            for index, more in enumerate(self._more):
                more.hold_match(match, index)

    def _release_match(self, match: PrefixMatch) -> None:
        """Undo `_hold_match` (the trie still holds the pages: none is freed)."""
        if match.node is not None:
            self._trie.unlock(match.node)
        self._pages.release_all(match.pages[max(match.num_locked_pages, match.num_released) :])
        if match.more_pages is not None:
            for index, more in enumerate(self._more):
                more.release_match(match, index)

    def _own_matched_pages(self, match: PrefixMatch, ops: list[MemoryOp]) -> list[int]:
        """The sequence's first pages: the held matched ones, the last copied
        if the hit ends inside it (the next token goes there)."""
        table = match.pages
        if not table:
            return []  # never the shared empty list of `_NO_MATCH`
        if match.num_tokens % self._block_size:
            src = table[-1]  # past the locked path, so owned (not borrowed)
            table[-1] = self._pages.take_one()
            self._pages.release(src)  # after the take: src cannot be handed out here
            ops.append(CopyBlock(src, table[-1], self._group))
        return table

    def _new_sequence_slot(self, snapshot: int | None, ops: list[MemoryOp]) -> int:
        """A fresh slot (hybrid only), zeroed or copied from the snapshot."""
        slot = self._slots.take_one()
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
        seq = self._resident(seq_id)
        num_tokens = check_count("num_tokens", num_tokens)
        num_pages, copy_page, copy_slot = self._growth(seq, num_tokens)
        more = self._more_growth(seq, num_pages) if self._more else None
        if not (num_pages or copy_page or copy_slot or (more and any(more))):
            return True  # the common decode step: room in the last page
        return self._can_reserve(num_pages + copy_page, copy_slot, more)

    def append(
        self, seq_id: Hashable, new_tokens: Iterable[int], num_computed: int | None = None
    ) -> Plan:
        """Reserve pages for tokens about to be computed; returns the plan.

        A partly filled last page or a slot shared with another owner is
        copied first (CoW). With a sliding window, pages no longer visible to
        the first token still to compute are released: `num_computed` is
        the count of computed tokens (None: every token before the new ones,
        or, after a commit restored a checkpoint, its position, kept until a
        count is given). O(1) amortised per token.
        """
        seq = self._resident(seq_id)
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
        elif self._fits_last_page(seq) and (
            num_computed is None or seq.more_tables is None or num_computed == len(seq.tokens)
        ):  # the common decode step: nothing to plan (further groups: no hold to move)
            seq.tokens.append(new_tokens[0])
            return NO_OPS
        if num_computed is not None and seq.speculation is None:
            self._check_computed_window(seq, num_computed)
        return self._append_tokens(seq, new_tokens, num_computed)

    def _append_tokens(self, seq: Sequence, new_tokens: list[int], num_computed: int | None) -> Plan:
        """`append` of checked tokens (at least one) to a resident sequence."""
        num_pages, copy_page, copy_slot = self._growth(seq, len(new_tokens))
        more = self._more_growth(seq, num_pages) if self._more else None
        grows = num_pages or copy_page or copy_slot or (more and any(more))
        if grows:
            self._reserve(num_pages + copy_page, copy_slot, more)  # may evict: events
        ops = self._make_writable(seq, copy_page, copy_slot)
        if num_pages:
            seq.block_table.extend(self._pages.take(num_pages))
        if more is not None:
            ops = self._grow_more(seq, more, num_pages, ops)
        num_before = len(seq.tokens)
        seq.tokens.extend(new_tokens)
        window = self._window
        release_from = num_before
        if seq.speculation is None and (num_computed is not None or seq.recompute_from is not None):
            release_from = self._move_recompute_hold(seq, num_before, num_computed)
        if (window is not None and seq.speculation is None
                and (release_from - window + 1) // self._block_size > seq.num_released):
            self._release_out_of_window(seq, release_from)  # a page fell out; speculating: at the commit
        if more is not None and seq.speculation is None:
            for index, group in enumerate(self._more):
                group.release_out_of_window(seq, index, release_from)
        if grows and self._events:
            self._deliver_events()
        return ops

    def _check_computed_window(self, seq: Sequence, num_computed: int) -> None:
        """Refuse a computed count whose next token attends to released pages
        (in any page group): computing from there would read pages that are
        gone. O(groups)."""
        if num_computed < len(seq.tokens) and not self._window_keeps(seq, num_computed):
            raise InvalidArgument(
                f"cannot append to {seq.seq_id!r} from {num_computed} computed tokens: "
                "pages its window needs were already released"
            )

    def _more_growth(self, seq: Sequence, num_pages: int) -> list[int]:
        """Pages each further page group needs to add tokens needing
        `num_pages` new pages: those plus a copy of a shared last page."""
        return [
            num_pages + group.copies_last_page(seq, index) for index, group in enumerate(self._more)
        ]

    def _grow_more(self, seq: Sequence, needs: list[int], num_pages: int, ops: Plan) -> Plan:
        """Copy shared last pages and add `num_pages` pages in every further
        page group (reserved: `needs` from `_more_growth`); `ops` plus the copies."""
        more_ops: list[MemoryOp] = []
        for index, (group, need) in enumerate(zip(self._more, needs)):
            group.grow(seq, index, need > num_pages, num_pages, more_ops)
        return (*ops, *more_ops) if more_ops else ops

    def can_append_decode(self, seq_ids: list[Hashable] | tuple[Hashable, ...]) -> bool:
        """Would `append_decode(seq_ids, tokens)` (any valid tokens) succeed
        now? Raises on bad ids like it; changes nothing. O(len(seq_ids))."""
        seqs = self._decode_seqs(seq_ids)
        return self._decode_room(self._plan_decode(seqs)) is None

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
        The plan is the rows' plans in row order. O(len(seq_ids)) plus the
        growing rows' page work.
        """
        seqs = self._decode_seqs(seq_ids)
        tokens = decode_tokens(tokens, len(seqs))
        plan = self._plan_decode(seqs)
        error = self._decode_room(plan)
        if error is not None:
            raise error
        growing = plan.growing
        if not growing:  # the common step: every row has room in its own last page
            for seq, token in zip(seqs, tokens):
                seq.tokens.append(token)
            return NO_OPS
        ops: list[MemoryOp] = []
        for index, (seq, token) in enumerate(zip(seqs, tokens)):
            if index in growing:
                ops.extend(self._append_tokens(seq, [token], None))
            else:
                seq.tokens.append(token)
        return tuple(ops)

    def _decode_seqs(self, seq_ids: object) -> list[Sequence]:
        """The live sequences of `seq_ids`, each once; raises naming a bad id
        (`_plan_decode` refuses a swapped one)."""
        if not isinstance(seq_ids, (list, tuple)):
            raise WrongArgumentType(f"seq_ids must be a list or tuple of ids, got {seq_ids!r:.80}")
        try:
            seqs = list(map(self._seqs.__getitem__, seq_ids))  # the common case, at C speed
        except (KeyError, TypeError):
            seqs = [self._resident(seq_id) for seq_id in seq_ids]  # raises, naming the id
        if len(set(map(id, seqs))) != len(seqs):
            raise InvalidArgument(f"seq_ids repeats a sequence: {seq_ids!r:.120}")
        return seqs

    def _plan_decode(self, seqs: list[Sequence]) -> DecodePlan:
        """The rows of a decode step that need more than a slot in their own
        last page, and the pages and slots they take at most. Pure; raises
        `SequenceSwapped` for a row swapped out."""
        growing: set[int] = set()
        num_pages = num_slots = 0
        more_pages = [0] * len(self._more) if self._more else None
        block_size, refcount = self._block_size, self._pages.refcount
        # Else every row may release pages or grow in a further group: the full check.
        plain = self._window is None and not self._more
        for index, seq in enumerate(seqs):
            if seq.swapped:
                self._resident(seq.seq_id)  # raises
            # `_fits_last_page(seq)`, written out: this loop runs once per decoded token.
            num_tokens = len(seq.tokens)
            table = seq.block_table
            if plain:
                if (seq.slot is None and seq.recompute_from is None
                        and num_tokens % block_size and num_tokens // block_size + 1 == len(table)
                        and refcount(table[-1]) == 1):
                    continue
            elif self._fits_last_page(seq):
                continue
            growing.add(index)
            pages, copy_page, copy_slot = self._growth(seq, 1)
            num_pages += pages + copy_page
            num_slots += copy_slot
            if more_pages is not None:
                for group, need in enumerate(self._more_growth(seq, pages)):
                    more_pages[group] += need
        return DecodePlan(growing, num_pages, num_slots, more_pages)

    def _decode_room(self, plan: DecodePlan) -> OutOfBlocks | OutOfSlots | None:
        """The error a decode step of `plan` would raise for lack of room, or
        None when it fits. Pure."""
        if not plan.growing:
            return None
        if not self._pages_shortfall_ok(plan.num_pages):
            return OutOfBlocks(
                f"a decode step needs up to {plan.num_pages} pages: {self._pages.num_free} "
                f"free of {self._pages.num_items}, not enough reclaimable from the prefix cache"
            )
        if not self._slots_shortfall_ok(plan.num_slots):
            return OutOfSlots(
                f"a decode step needs up to {plan.num_slots} slot copies: "
                f"{self.num_free_slots} free of {self.config.num_slots}, "
                "not enough reclaimable from the prefix cache"
            )
        short_group = None if plan.more_pages is None else self._more_shortfall_group(plan.more_pages)
        if short_group is not None:
            need = plan.more_pages[short_group.group - self._group - 1]
            return OutOfBlocks(
                f"a decode step needs up to {need} pages of group {short_group.group}: "
                f"{short_group.pages.num_free} free of {short_group.pages.num_items}, "
                "not enough reclaimable from the prefix cache"
            )
        return None

    def _fits_last_page(self, seq: Sequence) -> bool:
        """Would one more token go into the sequence's own last page with no
        page, copy or window release (`_growth(seq, 1)` all zero, no window
        on group 0) in every page group? O(groups)."""
        num_tokens = len(seq.tokens)
        table = seq.block_table
        return (
            self._window is None
            and seq.slot is None
            and seq.recompute_from is None
            and num_tokens % self._block_size != 0
            and num_tokens // self._block_size + 1 == len(table)
            and self._pages.refcount(table[-1]) == 1
            and (seq.more_tables is None or self._more_fit_next_token(seq, num_tokens))
        )

    def _more_fit_next_token(self, seq: Sequence, num_tokens: int) -> bool:
        """`_fits_last_page` in every further page group. O(groups)."""
        for index, group in enumerate(self._more):
            if not group.fits_next_token(seq, index, num_tokens):
                return False
        return True

    def _growth(self, seq: Sequence, num_new_tokens: int) -> tuple[int, bool, bool]:
        """(new pages, copy the last page?, copy the slot?) to add tokens."""
        num_tokens = len(seq.tokens)
        table = seq.block_table
        num_pages = -(-(num_tokens + num_new_tokens) // self._block_size) - len(table)
        copy_page = bool(num_tokens % self._block_size) and self._pages.refcount(table[-1]) > 1
        copy_slot = seq.slot is not None and self._slots.refcount(seq.slot) > 1
        return num_pages, copy_page, copy_slot

    def _make_writable(self, seq: Sequence, copy_page: bool, copy_slot: bool) -> Plan:
        """Give the sequence its own last page / slot (memory is reserved)."""
        if not (copy_page or copy_slot):
            return NO_OPS
        ops: list[MemoryOp] = []
        if copy_page:
            src = seq.block_table[-1]
            seq.block_table[-1] = self._pages.take_one()
            self._pages.release(src)  # shared, so it stays alive for the copy
            ops.append(CopyBlock(src, seq.block_table[-1], self._group))
        if copy_slot:
            src = seq.slot
            seq.slot = self._slots.take_one()
            self._slots.release(src)
            ops.append(CopySlot(src, seq.slot))
        return tuple(ops)

    @staticmethod
    def _move_recompute_hold(seq: Sequence, num_before: int, num_computed: int | None) -> int:
        """The first position still to compute (the window release keeps
        what it attends to); a given `num_computed` replaces the hold."""
        if num_computed is not None:
            seq.recompute_from = num_computed if num_computed < num_before else None
        hold = seq.recompute_from
        return num_before if hold is None else hold

    def _release_out_of_window(self, seq: Sequence, first_new_position: int) -> None:
        """Release pages the token at `first_new_position` can no longer see.

        A query at position p sees keys (p - W, p]; page j ends at
        (j + 1) * block_size - 1, so it is dead once (j + 1) * bs <= p - W + 1.
        """
        num_dead = max(0, first_new_position - self._window + 1) // self._block_size
        table = seq.block_table
        for index in range(seq.num_released, min(num_dead, len(table))):
            if index >= seq.num_borrowed:
                self._pages.release(table[index])
            table[index] = None
        seq.num_released = max(seq.num_released, min(num_dead, len(table)))

    # ------------------------------------------------------------------- fork

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> Plan:
        """Start `new_seq_id` as a copy of `seq_id`, sharing pages and slot.

        Fork once every reserved token of `seq_id` is computed; the first
        write of either sequence copies what it shares. O(pages).
        """
        seq = self._idle(seq_id)
        self._check_new_id(new_seq_id)
        table = list(seq.block_table)
        self._pages.incref_all(table[seq.first_owned :])
        for index, group in enumerate(self._more):
            group.share(seq, index)
        if seq.slot is not None:
            self._slots.incref(seq.slot)
        if seq.locked_node is not None:
            self._trie.lock(seq.locked_node)
        self._seqs[new_seq_id] = Sequence(
            new_seq_id,
            seq.namespace,
            list(seq.tokens),
            table,
            seq.slot,
            seq.locked_node,
            seq.num_released,
            anchored=seq.anchored,
            num_borrowed=seq.num_borrowed,  # the same lock holds them
            packed=seq.packed,
            recompute_from=seq.recompute_from,
            more_tables=None if seq.more_tables is None else [t[:] for t in seq.more_tables],
            more_released=None if seq.more_released is None else seq.more_released[:],
        )
        return NO_OPS

    # --------------------------------------------------------------- truncate

    def can_truncate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Would `truncate(seq_id, num_tokens)` succeed now? Changes nothing.

        Bad arguments still raise, as in `truncate`.
        """
        seq = self._idle(seq_id)
        num_tokens = self._check_truncate_target(seq, num_tokens)
        if num_tokens == len(seq.tokens):
            return True
        if not self._window_keeps(seq, num_tokens):
            return False
        if seq.slot is None:
            return True
        if num_tokens == 0:
            return self._slots.refcount(seq.slot) == 1 or self._slots_shortfall_ok(1)
        return self._snapshot_at(seq, num_tokens) is not None

    def truncate(self, seq_id: Hashable, num_tokens: int) -> Plan:
        """Roll the sequence back to its first `num_tokens` tokens.

        Pages past the new end are released. Recurrent state cannot be cut:
        a hybrid sequence takes the trie's snapshot at exactly `num_tokens`
        (shared, CoW) and `NoSnapshot` is raised when there is none. With a
        sliding window, rolling back past released pages is refused.
        """
        seq = self._idle(seq_id)
        num_tokens = self._check_truncate_target(seq, num_tokens)
        if num_tokens == len(seq.tokens):
            return NO_OPS
        if not self._window_keeps(seq, num_tokens):
            raise InvalidArgument(
                f"cannot truncate {seq_id!r} to {num_tokens} tokens: pages its "
                "window needs were already released"
            )
        ops, new_slot = self._rollback_slot(seq, num_tokens)
        keep = -(-num_tokens // self._block_size)
        table = seq.block_table
        self._pages.release_all(table[max(keep, seq.first_owned) :])
        del table[keep:]
        # A borrowed page the new end falls inside will be written: own it.
        num_borrowed = min(seq.num_borrowed, num_tokens // self._block_size)
        self._pages.incref_all(table[max(num_borrowed, seq.num_released) : seq.num_borrowed])
        for index, group in enumerate(self._more):
            group.truncate(seq, index, keep, num_borrowed)
        seq.num_borrowed = num_borrowed
        del seq.tokens[num_tokens:]
        if len(seq.packed) > num_tokens * TOKEN_BYTES:
            seq.packed = seq.packed[: num_tokens * TOKEN_BYTES]
        if seq.locked_node is not None and num_tokens < seq.locked_node.end:
            seq.anchored = False  # new tokens may differ from the node's
        seq.num_released = min(seq.num_released, keep)
        if seq.recompute_from is not None:
            seq.recompute_from = min(seq.recompute_from, num_tokens)
        if new_slot is not None:
            old_slot, seq.slot = seq.slot, new_slot
            self._slots.release(old_slot)
        if self._events:
            self._deliver_events()
        return ops

    def _check_truncate_target(self, seq: Sequence, num_tokens: int) -> int:
        num_tokens = check_count("num_tokens", num_tokens)
        if num_tokens > len(seq.tokens):
            raise InvalidArgument(
                f"cannot truncate {seq.seq_id!r} to {num_tokens} tokens: "
                f"it has {len(seq.tokens)}"
            )
        return num_tokens

    def _window_keeps(self, seq: Sequence, num_tokens: int) -> bool:
        """Are the pages the token at `num_tokens` would attend to still held
        (in every page group)?"""
        if self._more and not all(
            group.window_keeps(seq, index, num_tokens) for index, group in enumerate(self._more)
        ):
            return False
        if self._window is None or seq.num_released == 0:
            return True
        first_needed = max(0, num_tokens - self._window + 1) // self._block_size
        return num_tokens > 0 and first_needed >= seq.num_released

    def _snapshot_at(self, seq: Sequence, num_tokens: int):
        if self._trie is None:
            return None
        return self._trie.find_snapshot(seq.namespace, seq.tokens[:num_tokens])

    def _rollback_slot(self, seq: Sequence, num_tokens: int) -> tuple[Plan, int | None]:
        """The slot holding the state at `num_tokens` (a new reference) and ops."""
        if seq.slot is None:
            return NO_OPS, None
        if num_tokens == 0:
            if self._slots.refcount(seq.slot) == 1:
                self._slots.incref(seq.slot)  # the caller drops the old reference
                return (ZeroSlot(seq.slot),), seq.slot
            self._reserve(0, 1)
            slot = self._slots.take_one()
            return (ZeroSlot(slot),), slot
        node = self._snapshot_at(seq, num_tokens)
        if node is None:
            raise NoSnapshot(
                f"cannot roll {seq.seq_id!r} back to {num_tokens} tokens: no recurrent "
                "snapshot exists there (cache_prefix that point before speculating)"
            )
        self._slots.incref(node.slot)
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
        return self._can_reserve(plan.num_pages, plan.num_slots, plan.more_pages)

    def recompute_from(self, seq_id: Hashable) -> int | None:
        """The position a restored checkpoint is computed again from, while
        the window keeps what it attends to (None: no such hold)."""
        return self._get(seq_id).recompute_from

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
        self._reserve(plan.num_pages, plan.num_slots, plan.more_pages)
        ops = self._speculation.begin(plan)
        if self._events:
            self._deliver_events()
        return ops

    def commit_speculation(self, accepted: Mapping[Hashable, int]) -> frozenset:
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

    def abort_speculation(self, seq_ids: Iterable[Hashable]) -> None:
        """Close the transactions of `seq_ids` keeping no draft (a hybrid
        sequence gets its checkpoint back). All or nothing, as the commit."""
        if isinstance(seq_ids, (str, bytes)):
            raise WrongArgumentType(f"seq_ids must be a collection of ids, got {seq_ids!r:.80}")
        self.commit_speculation(dict.fromkeys(seq_ids, 0))

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
        spec = self._get(seq_id).speculation
        return None if spec is None else spec.start

    # ----------------------------------------------------------- cache/free

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> Plan:
        """Snapshot the sequence's first `num_tokens` tokens into the trie.

        Call it once those tokens are computed (None: all of them); for a
        hybrid model the sequence's slot must hold the state at exactly that
        point (the end of a prefill chunk). Pages are shared; the slot is
        copied (`CopySlot`). A no-op without a prefix cache. Raises
        `OutOfSlots` when no slot can be had for the snapshot.
        """
        seq = self._idle(seq_id)
        num_tokens = self._computed_count(seq, num_tokens)
        trie = self._trie
        if trie is None or num_tokens == 0:
            return NO_OPS
        snapshot = None
        if seq.slot is not None:
            self._reserve(0, 1)
            snapshot = self._slots.take_one()
        start = self._insert_start(seq, num_tokens)
        # From the sequence's lock (or with none) the lock moves to the node
        # the insert returns: the trie locks it before its LRU update, which
        # then leaves a new leaf out of the LRU list instead of in and out.
        moves = start is not None or seq.locked_node is None
        node, took_slot = self._insert(seq, num_tokens, snapshot, start, lock=moves)
        ops = NO_OPS
        if snapshot is not None:
            self._slots.release(snapshot)  # the trie holds its own reference
            if took_slot:
                ops = (CopySlot(seq.slot, snapshot),)
        self._move_lock(seq, node, locked=moves)
        if self._events:
            self._deliver_events()
        return ops

    def _insert(
        self, seq: Sequence, num_tokens: int, slot: int | None, start, *, lock: bool = False
    ):
        """Store the sequence's first `num_tokens` tokens (state `slot`) in the
        trie from `start` (`_insert_start`); the caller then drops the
        sequence's lock or moves it to the returned node (`lock`: the trie
        locks that node first, as `PrefixTrie.insert`'s `lock`). From the
        sequence's own unshared leaf the trie extends that leaf
        (`PrefixTrie.extend`: what the insert and that lock change give, at
        once). Returns `insert`'s (node, took_slot)."""
        trie = self._trie
        if start is not None and trie.can_extend(start, num_tokens, slot):  # reads no copy
            return trie.extend(
                start, seq.tokens, num_tokens, seq.block_table, seq.packed, lock=lock
            ), False
        tokens = seq.tokens if num_tokens == len(seq.tokens) else seq.tokens[:num_tokens]
        return trie.insert(
            seq.namespace, tokens, seq.block_table, slot, start, seq.packed, seq.more_tables,
            lock=lock,
        )

    @staticmethod
    def _insert_start(seq: Sequence, num_tokens: int):
        """The node a trie insert of the sequence's first `num_tokens` tokens
        may continue from (its anchored lock, which spells tokens[:end]), or
        None to walk from the root. Saves comparing the cached prefix again
        at every chunk end."""
        node = seq.locked_node
        return node if seq.anchored and node.end <= num_tokens else None

    def _move_lock(self, seq: Sequence, node, *, locked: bool = False) -> None:
        """Lock `node` (on the sequence's own path) instead of the current
        lock, unless the current one is deeper on that same path. `locked`:
        the insert that returned `node` locked it already (it continued from
        the current lock, or there is none: `node` is never shallower)."""
        old = seq.locked_node
        if node is None or (old is not None and seq.anchored and old.end > node.end):
            return
        if not locked:
            self._trie.lock(node)
        if old is not None:
            self._own_borrowed(seq)
            self._trie.unlock(old)
        seq.locked_node = node
        seq.anchored = True

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan:
        """End the sequence; its first `num_computed` tokens go into the trie.

        None means every token was computed. The slot (state after the last
        computed token) is handed to the trie with no copy; tokens already
        cached are not stored twice. Never fails for a live id. A swapped-out
        sequence just gives its host memory back. An open speculation is
        aborted first (`num_computed` counts from the tokens before it).
        """
        seq = self._get(seq_id)
        if seq.speculation is not None:
            self._speculation.check_free_count(seq, num_computed)
            self._speculation.end(seq, 0)  # drafts never reach the trie
        num_computed = self._computed_count(seq, num_computed)
        del self._seqs[seq_id]
        if seq.swapped:
            self._swap.release_host_copy(seq)
            return NO_OPS
        trie = self._trie
        node = seq.locked_node
        if trie is not None and num_computed:
            self._insert(seq, num_computed, seq.slot, self._insert_start(seq, num_computed))
        if node is not None:
            trie.unlock(node)
        table = seq.block_table
        first_owned = seq.first_owned
        self._pages.release_all(table[first_owned:] if first_owned else table)
        if self._more:
            for index, group in enumerate(self._more):
                group.release(seq, index)
        if seq.slot is not None:
            self._slots.release(seq.slot)
        if self._events:
            self._deliver_events()
        return NO_OPS

    def _own_borrowed(self, seq: Sequence) -> None:
        """Take the sequence's own references to its borrowed pages (before
        its lock moves or goes). O(borrowed pages)."""
        self._pages.incref_all(seq.block_table[seq.num_released : seq.num_borrowed])
        for index, group in enumerate(self._more):
            group.own_borrowed(seq, index)
        seq.num_borrowed = 0

    # ------------------------------------------------------------------ swap

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._get(seq_id).swapped

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Is there host memory to swap the sequence out? Changes nothing."""
        return self._swap.can_swap_out(self._idle(seq_id))

    def swap_out(self, seq_id: Hashable) -> Plan:
        """Copy the sequence's pages (and slot) to host memory and release them.

        The sequence stays live but frozen until `swap_in`; it leaves the trie
        alone (its lock is dropped). Raises `OutOfHostMemory`, changing
        nothing, when host memory is short. O(pages).
        """
        seq = self._idle(seq_id)
        if not self._swap.can_swap_out(seq):
            raise OutOfHostMemory(f"not enough host pages or slots to swap {seq_id!r} out")
        self._own_borrowed(seq)  # so that moving releases every page alike
        ops = self._swap.swap_out(seq)
        if seq.locked_node is not None:
            self._trie.unlock(seq.locked_node)
            seq.locked_node = None
            seq.anchored = False
        return tuple(ops)

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Are there device pages (and a slot) to swap it back in? Changes nothing."""
        return self._can_reserve(*self._swap.swap_in_needs(self._swapped(seq_id)))

    def swap_in(self, seq_id: Hashable) -> Plan:
        """Bring a swapped-out sequence back to fresh device pages (and slot).

        May evict cache entries; raises `OutOfBlocks` / `OutOfSlots`,
        changing nothing, when device memory is short. O(pages).
        """
        seq = self._swapped(seq_id)
        self._reserve(*self._swap.swap_in_needs(seq))
        ops = self._swap.swap_in(seq)
        if self._events:
            self._deliver_events()
        return tuple(ops)

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
        self._listener_errors.extend(self._trie.deliver_events())

    # ------------------------------------------------------------- internals

    def _get(self, seq_id: Hashable) -> Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"no live sequence {seq_id!r}") from None

    def _idle(self, seq_id: Hashable) -> Sequence:
        """The resident sequence, which must have no speculation open."""
        seq = self._resident(seq_id)
        if seq.speculation is not None:
            raise SpeculationInFlight(
                f"sequence {seq_id!r} has a speculation open; commit or abort it first"
            )
        return seq

    def _resident(self, seq_id: Hashable) -> Sequence:
        """The live sequence, which must not be swapped out."""
        seq = self._get(seq_id)
        if seq.swapped:
            raise SequenceSwapped(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def _swapped(self, seq_id: Hashable) -> Sequence:
        seq = self._get(seq_id)
        if not seq.swapped:
            raise InvalidArgument(f"sequence {seq_id!r} is not swapped out")
        return seq

    def _check_new_id(self, seq_id: Hashable) -> None:
        try:
            exists = seq_id in self._seqs
        except TypeError:
            raise InvalidArgument(f"sequence id must be hashable, got {seq_id!r}") from None
        if exists:
            raise DuplicateSequence(f"sequence {seq_id!r} is already live")

    def _computed_count(self, seq: Sequence, num_computed: int | None) -> int:
        if num_computed is None:
            return len(seq.tokens)
        num_computed = check_count("num_computed", num_computed)
        if num_computed > len(seq.tokens):
            raise InvalidArgument(
                f"{seq.seq_id!r} has {len(seq.tokens)} tokens, not {num_computed}"
            )
        return num_computed

    def _match(
        self, namespace: Hashable, tokens: list[int], packed: bytes, limit: int | None = None
    ) -> PrefixMatch:
        if self._trie is None:
            return _NO_MATCH
        cap = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
        return self._trie.match(namespace, tokens, cap, packed)

    def _num_new_pages(self, num_tokens: int, num_cached: int) -> int:
        block_size = self._block_size
        num_shared = -(-num_cached // block_size)
        copy_last = 1 if num_cached % block_size else 0
        return -(-num_tokens // block_size) - num_shared + copy_last

    def _watermark(self) -> int:
        return self._num_watermark_blocks

    def _with_match_held(self, match: PrefixMatch, check, *args) -> bool:
        """Run a feasibility check with the match held (as allocate does)."""
        self._hold_match(match)
        try:
            return check(*args)
        finally:
            self._release_match(match)

    def _can_reserve(self, num_pages: int, num_slots: int, more: list[int] | None = None) -> bool:
        """Are `num_pages` pages and `num_slots` slots free or reclaimable
        (and `more[i]` pages of further page group i)? Pure."""
        return (
            self._pages_shortfall_ok(num_pages)
            and self._slots_shortfall_ok(num_slots)
            and (more is None or self._more_shortfall_group(more) is None)
        )

    def _more_needs(self, num_pages: int) -> list[int]:
        """`num_pages` new pages in every further page group, past its watermark."""
        return [num_pages + more.num_watermark_blocks for more in self._more]

    def _more_fit(self, needs: list[int]) -> bool:
        """Are `needs[i]` pages free in further page group i (no eviction)?"""
        for need, more in zip(needs, self._more):
            if need > more.pages.num_free:
                return False
        return True

    def _more_shortfall_group(self, needs: list[int]) -> PageGroup | None:
        """The first further page group whose need eviction cannot meet. Pure."""
        trie = self._trie
        for index, (need, more) in enumerate(zip(needs, self._more), 1):
            short = need - more.pages.num_free
            if short > 0 and (trie is None or not trie.can_free_pages(short, index)):
                return more
        return None

    def _pages_shortfall_ok(self, num_pages: int) -> bool:
        short = num_pages - self._pages.num_free
        return short <= 0 or (self._trie is not None and self._trie.can_free_pages(short))

    def _slots_shortfall_ok(self, num_slots: int) -> bool:
        if self._slots is None or num_slots == 0:
            return True
        short = num_slots - self._slots.num_free
        return short <= 0 or (self._trie is not None and self._trie.can_free_slots(short))

    def _reserve(self, num_pages: int, num_slots: int, more: list[int] | None = None) -> None:
        """Make `num_pages` pages and `num_slots` slots free (and `more[i]`
        pages of further page group i), evicting LRU cache entries if
        needed; raise (changing nothing) when that cannot work."""
        slots = self._slots
        if num_pages <= self._pages.num_free and (
            slots is None or num_slots <= slots.num_free
        ) and (more is None or self._more_fit(more)):
            return  # the common case: nothing to evict
        if not self._pages_shortfall_ok(num_pages):
            raise OutOfBlocks(
                f"need {num_pages} pages: {self._pages.num_free} free of "
                f"{self._pages.num_items}, not enough reclaimable from the prefix cache"
            )
        if not self._slots_shortfall_ok(num_slots):
            raise OutOfSlots(
                f"need {num_slots} slots: {self.num_free_slots} free of "
                f"{self.config.num_slots}, not enough reclaimable from the prefix cache"
            )
        short_group = None if more is None else self._more_shortfall_group(more)
        if short_group is not None:
            raise OutOfBlocks(
                f"need {more[short_group.group - self._group - 1]} pages of group "
                f"{short_group.group}: {short_group.pages.num_free} free of "
                f"{short_group.pages.num_items}, not enough reclaimable from the prefix cache"
            )
        trie = self._trie
        if trie is not None:
            if num_pages > self._pages.num_free:
                trie.evict_pages(num_pages)
            if self._slots is not None and num_slots > self._slots.num_free:
                trie.evict_slots(num_slots)
            for index, need in enumerate(more or (), 1):
                trie.evict_pages(need, index)
        if num_pages > self._pages.num_free or (
            self._slots is not None and num_slots > self._slots.num_free
        ) or (more is not None and not self._more_fit(more)):
            raise IntegrityError("eviction freed less than its plan promised")

    # -------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if any invariant is broken. O(state size).

        Refcounts equal the references held by sequences and the trie; free
        and used ids add up; no id is both free and referenced; each table
        covers exactly its sequence's tokens; trie invariants hold.
        """
        page_refs = [0] * self._pages.num_items
        slot_refs = [0] * self._slots.num_items if self._slots is not None else None
        host_page_refs = [0] * self._host_pages.num_items
        host_slot_refs = [0] * self._host_slots.num_items
        more_refs = [[0] * group.pages.num_items for group in self._more]
        more_host_refs = [[0] * group.host_pages.num_items for group in self._more]
        locks: dict[int, int] = {}
        for seq in self._seqs.values():
            where = f"sequence {seq.seq_id!r}"
            if (seq.more_tables is None) != (not self._more) or (
                self._more and not (len(seq.more_tables) == len(seq.more_released) == len(self._more))
            ):
                raise IntegrityError(f"{where} has page tables of other groups than the manager's")
            for index, group in enumerate(self._more):
                refs = more_host_refs if seq.swapped else more_refs
                group.check_sequence(seq, index, refs[index], where)
            if seq.swapped:
                self._check_sequence(seq, host_page_refs, host_slot_refs, locks)
            else:
                self._check_sequence(seq, page_refs, slot_refs, locks)
        if self._trie is not None:
            self._trie.add_references(page_refs, slot_refs, more_refs)
            self._trie.check_integrity(locks)
        for group, refs, host_refs in zip(self._more, more_refs, more_host_refs):
            group.pages.check_integrity(refs, f"page of group {group.group}")
            group.host_pages.check_integrity(host_refs, f"host page of group {group.group}")
        self._pages.check_integrity(page_refs, "page")
        self._host_pages.check_integrity(host_page_refs, "host page")
        self._host_slots.check_integrity(host_slot_refs, "host slot")
        if self._slots is not None:
            self._slots.check_integrity(slot_refs, "slot")

    def _check_sequence(
        self,
        seq: Sequence,
        page_refs: list[int],
        slot_refs: list[int] | None,
        locks: dict[int, int],
    ) -> None:
        where = f"sequence {seq.seq_id!r}"
        table = seq.block_table
        num_pages = -(-len(seq.tokens) // self._block_size)
        if len(table) != num_pages:
            raise IntegrityError(f"{where} has {len(table)} pages for {len(seq.tokens)} tokens")
        first_owned = seq.first_owned
        for index, page in enumerate(table):
            released = index < seq.num_released
            if (page is None) != released:
                raise IntegrityError(f"{where}: page {index} released out of order")
            if index >= first_owned:
                page_refs[page] += 1
        if seq.packed != pack_tokens(seq.tokens[: len(seq.packed) // TOKEN_BYTES]):
            raise IntegrityError(f"{where} has stale packed tokens")
        if seq.num_released and self._window is None:
            raise IntegrityError(f"{where} released pages without a sliding window")
        if (seq.slot is None) != (self._slots is None):
            raise IntegrityError(f"{where} slot {seq.slot} does not fit the model kind")
        if seq.swapped and seq.locked_node is not None:
            raise IntegrityError(f"{where} is swapped out but locks the trie")
        if seq.slot is not None:
            slot_refs[seq.slot] += 1
        if seq.speculation is not None:
            self._check_speculation(seq, where, slot_refs)
        self._check_recompute_hold(seq, seq.recompute_from, len(seq.tokens), where)
        node = seq.locked_node
        if node is not None and node.parent is None:
            raise IntegrityError(f"{where} locks a node that left the trie")
        if seq.anchored and (node is None or self._path_tokens(node) != seq.tokens[: node.end]):
            raise IntegrityError(f"{where} is anchored at a node that spells other tokens")
        if seq.num_borrowed:
            self._check_borrowed(seq, where)
        while node is not None and node.parent is not None:
            locks[node.node_id] = locks.get(node.node_id, 0) + 1
            node = node.parent

    def _check_speculation(self, seq: Sequence, where: str, slot_refs) -> None:
        """An open transaction: resident, its start within the tokens, a
        checkpoint slot exactly when hybrid, its own, distinct from the
        working one."""
        spec = seq.speculation
        if seq.swapped or not 0 <= spec.start <= len(seq.tokens):
            raise IntegrityError(f"{where} speculates from {spec.start} (or while swapped out)")
        if (spec.checkpoint is None) != (seq.slot is None) or (
            spec.checkpoint is not None and spec.checkpoint == seq.slot
        ):
            raise IntegrityError(f"{where}: checkpoint {spec.checkpoint} beside slot {seq.slot}")
        if spec.checkpoint is not None:
            slot_refs[spec.checkpoint] += 1
            # A restore makes the sequence compute into it: never shared.
            if self._slots.refcount(spec.checkpoint) != 1:
                raise IntegrityError(f"{where}: checkpoint {spec.checkpoint} is shared")
        if seq.recompute_from is not None:
            raise IntegrityError(f"{where} holds {seq.recompute_from} beside its transaction")
        self._check_recompute_hold(seq, spec.recompute_from, spec.start, where)

    def _check_recompute_hold(self, seq: Sequence, position: int | None, limit: int, where: str) -> None:
        """A position to compute again from: within `limit`, its window held."""
        if position is not None and not (
            0 <= position <= limit and (seq.swapped or self._window_keeps(seq, position))
        ):
            raise IntegrityError(f"{where} recomputes from {position} but its window is released")

    def _check_borrowed(self, seq: Sequence, where: str) -> None:
        """Borrowed pages are full, inside the locked path, held at their
        index by a node of that path, and spell the sequence's tokens."""
        node, num_borrowed = seq.locked_node, seq.num_borrowed
        end = num_borrowed * self._block_size
        if node is None or seq.swapped or num_borrowed < 0:
            raise IntegrityError(f"{where} borrows pages without a lock (or while swapped out)")
        if end > node.end or end > len(seq.tokens):
            raise IntegrityError(f"{where} borrows {num_borrowed} pages past its lock or end")
        if self._path_tokens(node)[:end] != seq.tokens[:end]:
            raise IntegrityError(f"{where} borrows pages that hold other tokens")
        held = set()
        block_size = self._block_size
        while node.parent is not None:
            first = node.start // block_size
            held.update(enumerate(node.blocks, first))
            for group, blocks in enumerate(node.more or (), 1):
                held.update(((group, index), page) for index, page in enumerate(blocks, first))
            node = node.parent
        for index in range(seq.num_released, num_borrowed):
            if (index, seq.block_table[index]) not in held:
                raise IntegrityError(f"{where}: borrowed page {index} is not on its locked path")
        for group, (table, released) in enumerate(
            zip(seq.more_tables or (), seq.more_released or ()), 1
        ):
            for index in range(released, num_borrowed):
                if ((group, index), table[index]) not in held:
                    raise IntegrityError(
                        f"{where}: borrowed page {index} of group {group} is not on its locked path"
                    )

    @staticmethod
    def _path_tokens(node) -> list[int]:
        runs = []
        while node.parent is not None:
            runs.append(node.tokens)
            node = node.parent
        return list(chain.from_iterable(reversed(runs)))  # flattened at C speed

    def debug_state(self) -> tuple:
        """Everything observable, as plain values: equal before and after any
        call that failed. For tests; O(state size)."""
        seqs = tuple(
            (
                seq_id,
                seq.namespace,
                tuple(seq.tokens),
                tuple(seq.block_table),
                seq.slot,
                seq.locked_node.node_id if seq.locked_node is not None else None,
                seq.num_released,
                seq.swapped,
                seq.anchored,
                seq.num_borrowed,
                None if seq.speculation is None else (
                    seq.speculation.start, seq.speculation.checkpoint,
                    seq.speculation.recompute_from,
                ),
                seq.recompute_from,
                None if seq.more_tables is None else tuple(map(tuple, seq.more_tables)),
                None if seq.more_released is None else tuple(seq.more_released),
            )
            for seq_id, seq in self._seqs.items()
        )
        pools = (
            tuple(self._pages.free_items()),
            tuple(self._pages.refcounts()),
            tuple(self._slots.free_items()) if self._slots is not None else None,
            tuple(self._slots.refcounts()) if self._slots is not None else None,
            tuple(self._host_pages.free_items()),
            tuple(self._host_pages.refcounts()),
            tuple(self._host_slots.free_items()),
            tuple(self._host_slots.refcounts()),
            tuple(
                (tuple(g.pages.free_items()), tuple(g.pages.refcounts()),
                 tuple(g.host_pages.free_items()), tuple(g.host_pages.refcounts()))
                for g in self._more
            ),
        )
        counters = (
            self._num_queries,
            self._num_hits,
            self._num_query_tokens,
            self._num_hit_tokens,
        )
        trie = self._trie.debug_state() if self._trie is not None else None
        return seqs, pools, counters, trie


#: The match of a manager without a prefix cache (never mutated: empty pages).
_NO_MATCH = PrefixMatch()

