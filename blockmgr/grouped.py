"""`GroupedStore`: the bookkeeping of every layer group of one model.

Real models mix layer kinds: full attention, sliding-window attention (one
group per distinct window) and recurrent layers (slots). Each group keeps its
own pages and prefix trie in a `BlockManager` (group 0 also keeps the
recurrent slots); the store drives them as one:

* every call has `BlockManager`'s meaning, and succeeds in every group or
  raises and changes nothing in any: the checks of all groups run before
  the first group changes;
* `allocate` first finds the hit every group can serve (a fixed point over
  the groups' hit lengths: a recurrent snapshot or a sliding window's pages
  exist only at some points, so each group is asked again with the shorter
  limit until all agree), then allocates every group with it;
* page ops carry their group (`CopyBlock.group`, ...), slot ops need none.

With a single group the store is that group's manager: the calls are bound
straight to it (no cost over a plain `BlockManager`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from blockmgr.config import GroupedStoreConfig
from blockmgr.errors import (
    DuplicateSequence,
    IntegrityError,
    InvalidArgument,
    OutOfHostMemory,
    WrongArgumentType,
)
from blockmgr.manager import BlockManager
from blockmgr.ops import MemoryOp
from blockmgr.prefix_trie import PrefixCacheListener, PrefixMatch
from blockmgr.sequence import Allocation
from blockmgr.stats import PrefixCacheStats
from blockmgr.validation import check_hashable, packed_prompt, token_list

Plan = tuple[MemoryOp, ...]

#: The calls a single-group store binds straight to its manager.
_SINGLE_GROUP_CALLS = (
    "can_allocate", "allocate", "cached_prefix_length", "can_append", "append",
    "can_append_decode", "append_decode", "fork",
    "can_truncate", "truncate", "cache_prefix", "free", "can_swap_out", "swap_out",
    "can_swap_in", "swap_in", "can_speculate", "begin_speculation", "commit_speculation",
    "abort_speculation",
)


class GroupedStore:
    """Pages, slots and prefix tries of all layer groups of one model.

    Not thread-safe. Each call costs the sum of its groups' `BlockManager`
    calls (plus, for `allocate`, one more `find_prefix` per group each time
    a group lowers the common hit).
    """

    def __init__(
        self, config: GroupedStoreConfig, listener: PrefixCacheListener | None = None
    ) -> None:
        """`listener` follows group 0's prefix cache (see `PrefixCacheListener`)."""
        if not isinstance(config, GroupedStoreConfig):
            raise InvalidArgument(f"config must be a GroupedStoreConfig, got {config!r}")
        self.config = config
        self._managers = tuple(
            BlockManager(config.group_config(g), listener if g == 0 else None, group=g)
            for g in range(config.num_groups)
        )
        self._first = self._managers[0]
        self._others = self._managers[1:]
        if len(self._managers) == 1:
            # One group: every call is its manager's (bound here, not wrapped).
            for name in _SINGLE_GROUP_CALLS:
                setattr(self, name, getattr(self._first, name))

    # ------------------------------------------------------------- queries

    @property
    def managers(self) -> tuple[BlockManager, ...]:
        """One `BlockManager` per group, group 0 first (read them; do not call
        their sequence methods: the groups would drift apart)."""
        return self._managers

    @property
    def num_groups(self) -> int:
        return len(self._managers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.config.windows

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def is_hybrid(self) -> bool:
        return self.config.is_hybrid

    @property
    def enable_prefix_cache(self) -> bool:
        return self.config.enable_prefix_cache

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def num_usable_blocks(self) -> int:
        """Pages one sequence may hold in an empty store (the smallest group's)."""
        return min(m.num_usable_blocks for m in self._managers)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._first

    @property
    def num_sequences(self) -> int:
        return self._first.num_sequences

    def sequence_ids(self) -> list[Hashable]:
        return self._first.sequence_ids()

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int | None]:
        """A copy of the sequence's page table in `group`."""
        return self._manager(group).block_table(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._first.num_tokens(seq_id)

    def tokens(self, seq_id: Hashable) -> list[int]:
        return self._first.tokens(seq_id)

    def slot(self, seq_id: Hashable) -> int | None:
        return self._first.slot(seq_id)

    def namespace(self, seq_id: Hashable) -> Hashable:
        return self._first.namespace(seq_id)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._first.is_swapped(seq_id)

    @property
    def num_free_blocks(self) -> int:
        """Free pages of the group with the fewest (the binding one)."""
        return min(m.num_free_blocks for m in self._managers)

    @property
    def num_free_slots(self) -> int:
        return self._first.num_free_slots

    @property
    def num_cached_blocks(self) -> int:
        """Pages held by the prefix tries of all groups."""
        return sum(m.num_cached_blocks for m in self._managers)

    @property
    def usage(self) -> float:
        """Fraction of pages in use in the fullest group."""
        return max(m.usage for m in self._managers)

    @property
    def stats(self) -> PrefixCacheStats:
        """Queries and hits (the same in every group) and the tries' sizes, summed."""
        per_group = [m.stats for m in self._managers]
        first = per_group[0]
        return PrefixCacheStats(
            num_queries=first.num_queries,
            num_hits=first.num_hits,
            num_query_tokens=first.num_query_tokens,
            num_hit_tokens=first.num_hit_tokens,
            num_evicted_pages=sum(s.num_evicted_pages for s in per_group),
            num_evicted_nodes=sum(s.num_evicted_nodes for s in per_group),
            num_trie_nodes=sum(s.num_trie_nodes for s in per_group),
            num_trie_pages=sum(s.num_trie_pages for s in per_group),
            num_trie_slots=first.num_trie_slots,
        )

    # --------------------------------------------------------------- allocate

    def cached_prefix_length(self, tokens: Iterable[int], namespace: Hashable = None) -> int:
        """How many tokens `allocate` would reuse right now (every group). Pure."""
        tokens, packed = _checked(tokens, namespace)
        return self._common_hit(tokens, namespace, packed)[0].num_tokens

    @property
    def cache_version(self) -> int:
        """`BlockManager.cache_version` over every group (their sum). O(groups)."""
        return sum(m.cache_version for m in self._managers)

    def cached_paths(self) -> list[tuple[Hashable, list[int]]]:
        """Group 0's `BlockManager.cached_paths`: a hit every group can serve
        is a prefix of one of them (group 0 serves it too). Pure."""
        return self._first.cached_paths()

    def can_allocate(self, tokens: Iterable[int], namespace: Hashable = None) -> bool:
        """Would `allocate(..., tokens, namespace)` succeed now? Changes nothing."""
        tokens, packed = _checked(tokens, namespace)
        matches = self._common_hit(tokens, namespace, packed)
        return all(
            m.can_allocate(tokens, namespace, match=match, packed=packed)
            for m, match in zip(self._managers, matches)
        )

    def allocate(
        self, seq_id: Hashable, tokens: Iterable[int], namespace: Hashable = None
    ) -> Allocation:
        """Reserve pages (and a slot) in every group for a new prompt.

        Reuses the longest prefix every group can serve (`num_cached_tokens`);
        `branch_point` is the furthest point where a group could serve more
        after a `cache_prefix` there. Raises like `BlockManager.allocate`,
        changing no group. O(groups x (prompt pages + matched tokens)).
        """
        _check_new_id(self._first, seq_id)
        tokens, packed = _checked(tokens, namespace)
        groups = tuple(zip(self._managers, self._common_hit(tokens, namespace, packed)))
        (first_manager, first_match), *others = groups
        for m, match in others:
            if not m.can_allocate(tokens, namespace, match=match, packed=packed):
                self._raise_allocate_error(seq_id, tokens, namespace, packed, groups)
        # Group 0 checks itself (raising, nothing changed, when it lacks room);
        # the others were checked, and no group's allocate touches another's
        # pools or trie. Each keeps its own token list: group 0 the checked one.
        first = first_manager.allocate(seq_id, tokens, namespace, match=first_match, packed=packed)
        for m, match in others:
            more = m.allocate(seq_id, tokens[:], namespace, match=match, packed=packed)
            _merge_allocation(first, more)
        return first

    @staticmethod
    def _raise_allocate_error(
        seq_id: Hashable, tokens: list, namespace: Hashable, packed: bytes, groups: tuple
    ) -> None:
        """Raise the error of the first group (in group order) that cannot
        allocate, changing nothing."""
        for m, match in groups:
            if not m.can_allocate(tokens, namespace, match=match, packed=packed):
                m.allocate(seq_id, tokens, namespace, match=match, packed=packed)  # raises
                raise IntegrityError("allocate succeeded where can_allocate said no")
        raise IntegrityError("can_allocate changed its answer within one call")

    def _common_hit(self, tokens: list, namespace: Hashable, packed: bytes) -> list[PrefixMatch]:
        """Each group's match at the longest hit all groups can serve.

        A group asked with a limit returns its longest servable hit within it;
        the limit only falls, and the loop ends once every group in a row
        agreed with it. Pure; `tokens` and `packed` come from `_checked`.
        """
        managers = self._managers
        limit = len(tokens)
        matches: list[PrefixMatch] = [None] * len(managers)  # type: ignore[list-item]
        num_agreeing, g = 0, 0
        while num_agreeing < len(managers):
            match = managers[g].find_prefix(tokens, namespace, limit, packed=packed)
            matches[g] = match
            if match.num_tokens < limit:
                limit = match.num_tokens
                num_agreeing = 1
            else:
                num_agreeing += 1
            g = (g + 1) % len(managers)
        return matches

    # ----------------------------------------------------------------- append

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Would `append` of `num_tokens` tokens succeed in every group? Pure."""
        return all(m.can_append(seq_id, num_tokens) for m in self._managers)

    def append(
        self, seq_id: Hashable, new_tokens: Iterable[int], num_computed: int | None = None
    ) -> Plan:
        """Reserve pages in every group for tokens about to be computed
        (`num_computed`: see `BlockManager.append`).

        Raises `OutOfBlocks` / `OutOfSlots` (nothing changed) when any group
        lacks room after eviction. O(groups) per token, amortised.
        """
        if type(new_tokens) is not list:
            new_tokens = token_list(new_tokens, "new_tokens")
        others = self._others
        num_tokens = len(new_tokens)
        for m in others:
            if not m.can_append(seq_id, num_tokens):
                m.append(seq_id, new_tokens, num_computed)  # raises its precise error, changes nothing
                raise IntegrityError("append succeeded where can_append said no")
        ops = self._first.append(seq_id, new_tokens, num_computed)  # checks itself: nothing changed yet
        for m in others:
            more = m.append(seq_id, new_tokens, num_computed)
            if more:
                ops = (*ops, *more)
        return ops

    def can_append_decode(self, seq_ids: list[Hashable] | tuple[Hashable, ...]) -> bool:
        """Would `append_decode(seq_ids, tokens)` succeed in every group? Pure."""
        return all(m.can_append_decode(seq_ids) for m in self._managers)

    def append_decode(
        self, seq_ids: list[Hashable] | tuple[Hashable, ...], tokens: Iterable[int]
    ) -> Plan:
        """`BlockManager.append_decode` in every group: one token per row.
        Every group is checked before the first changes (a refusing group's
        error is raised, nothing changed); the plan is group 0's rows,
        then group 1's, ... O(groups x rows)."""
        for m in self._others:
            if not m.can_append_decode(seq_ids):  # checks the ids too
                m.append_decode(seq_ids, tokens)  # raises its precise error, changes nothing
                raise IntegrityError("append_decode succeeded where can_append_decode said no")
        ops = self._first.append_decode(seq_ids, tokens)  # checks itself and the tokens
        for m in self._others:
            more = m.append_decode(seq_ids, tokens)
            if more:
                ops = (*ops, *more)
        return ops

    # -------------------------------------------------------- fork / truncate

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> Plan:
        """`new_seq_id` shares `seq_id`'s pages in every group (and its slot)."""
        ops = list(self._first.fork(seq_id, new_seq_id))  # validates both ids
        for m in self._managers[1:]:
            ops.extend(m.fork(seq_id, new_seq_id))  # cannot fail once group 0 forked
        return tuple(ops)

    def can_truncate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Would `truncate` succeed in every group? Bad arguments still raise."""
        return all(m.can_truncate(seq_id, num_tokens) for m in self._managers)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> Plan:
        """Roll the sequence back in every group (see `BlockManager.truncate`)."""
        for m in self._managers:
            if not m.can_truncate(seq_id, num_tokens):
                m.truncate(seq_id, num_tokens)  # raises its precise error, changes nothing
                raise IntegrityError("truncate succeeded where can_truncate said no")
        return tuple(op for m in self._managers for op in m.truncate(seq_id, num_tokens))

    # ------------------------------------------------------------ speculation

    def can_speculate(
        self,
        drafts: Mapping[Hashable, Iterable[int]],
        num_computed: Mapping[Hashable, int] | None = None,
    ) -> bool:
        """Would `begin_speculation(drafts, num_computed)` succeed in every
        group? Pure."""
        drafts, num_computed = self._checked_drafts(drafts, num_computed)
        return all(m.can_speculate(drafts, num_computed) for m in self._managers)

    def begin_speculation(
        self,
        drafts: Mapping[Hashable, Iterable[int]],
        num_computed: Mapping[Hashable, int] | None = None,
    ) -> Plan:
        """Open speculation transactions in every group (see
        `BlockManager.begin_speculation`); all or nothing. A hybrid store
        gives every group group 0's recompute positions, so that a sliding
        group keeps the pages a restored checkpoint's recompute attends to."""
        drafts, num_computed = self._checked_drafts(drafts, num_computed)
        for m in self._managers:
            if not m.can_speculate(drafts, num_computed):
                m.begin_speculation(drafts, num_computed)  # raises its precise error, changes nothing
                raise IntegrityError("begin_speculation succeeded where can_speculate said no")
        return tuple(op for m in self._managers for op in m.begin_speculation(drafts, num_computed))

    def commit_speculation(self, accepted: Mapping[Hashable, int]) -> frozenset:
        """Keep each sequence's accepted drafts in every group; returns the
        sequences whose recurrent checkpoint came back (group 0 keeps the
        slots). Group 0 checks the argument first: the others cannot fail."""
        restored = self._first.commit_speculation(accepted)
        for m in self._managers[1:]:
            m.commit_speculation(accepted)
        return restored

    def abort_speculation(self, seq_ids: Iterable[Hashable]) -> None:
        """Close the transactions of `seq_ids` keeping no draft, in every group."""
        if isinstance(seq_ids, (str, bytes)):
            raise WrongArgumentType(f"seq_ids must be a collection of ids, got {seq_ids!r:.80}")
        self.commit_speculation(dict.fromkeys(seq_ids, 0))

    def speculation_start(self, seq_id: Hashable) -> int | None:
        return self._first.speculation_start(seq_id)

    def recompute_from(self, seq_id: Hashable) -> int | None:
        return self._first.recompute_from(seq_id)

    def _checked_drafts(self, drafts, num_computed) -> tuple[dict, Mapping | None]:
        """The drafts as lists, checked once for every group, and the
        recompute positions every group gets: a hybrid store's default is
        group 0's (its hold, else all tokens), for the sliding groups too."""
        if not isinstance(drafts, Mapping):
            raise WrongArgumentType(f"drafts must be a mapping, got {drafts!r:.80}")
        drafts = {seq_id: token_list(t, f"drafts[{seq_id!r}]") for seq_id, t in drafts.items()}
        if not self.is_hybrid or (num_computed is not None and not isinstance(num_computed, Mapping)):
            return drafts, num_computed  # the managers check it
        given = {} if num_computed is None else num_computed
        positions = {}
        for seq_id in drafts:
            if seq_id in given:
                positions[seq_id] = given[seq_id]
            else:
                hold = self._first.recompute_from(seq_id)  # raises for an unknown id
                positions[seq_id] = self._first.num_tokens(seq_id) if hold is None else hold
        if not given.keys() <= drafts.keys():
            return drafts, given  # the managers raise the precise error
        return drafts, positions

    # ------------------------------------------------------------- cache/free

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> Plan:
        """Snapshot the computed prefix into every group's trie.

        Only group 0 can fail (`OutOfSlots` for the snapshot's slot), so it
        goes first; the other groups only take page references.
        """
        ops = list(self._first.cache_prefix(seq_id, num_tokens))
        for m in self._managers[1:]:
            ops.extend(m.cache_prefix(seq_id, num_tokens))
        return tuple(ops)

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan:
        """End the sequence in every group; its computed tokens enter the tries.
        Never fails for a live id (group 0 checks the arguments first)."""
        ops = self._first.free(seq_id, num_computed)
        for m in self._others:
            more = m.free(seq_id, num_computed)
            if more:
                ops += more
        return ops

    def take_listener_errors(self) -> list[tuple[str, BaseException]]:
        """What the listener (on group 0) raised since the last call; see
        `BlockManager.take_listener_errors`."""
        return self._first.take_listener_errors()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix no live sequence uses, in every group."""
        for m in self._managers:
            m.reset_prefix_cache()

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, seq_id: Hashable) -> bool:
        return all(m.can_swap_out(seq_id) for m in self._managers)

    def swap_out(self, seq_id: Hashable) -> Plan:
        """Move the sequence to host memory in every group; raises
        `OutOfHostMemory` (nothing changed) when any group lacks room."""
        if not self.can_swap_out(seq_id):
            raise OutOfHostMemory(f"not enough host pages or slots to swap {seq_id!r} out")
        return tuple(op for m in self._managers for op in m.swap_out(seq_id))

    def can_swap_in(self, seq_id: Hashable) -> bool:
        return all(m.can_swap_in(seq_id) for m in self._managers)

    def swap_in(self, seq_id: Hashable) -> Plan:
        """Bring the sequence back to device memory in every group."""
        for m in self._managers:
            if not m.can_swap_in(seq_id):
                m.swap_in(seq_id)  # raises its precise error, changes nothing
                raise IntegrityError("swap_in succeeded where can_swap_in said no")
        return tuple(op for m in self._managers for op in m.swap_in(seq_id))

    # -------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if any invariant is broken. O(state size).

        Each group's own invariants hold, and every group holds the same
        sequences with the same tokens, namespace and swap state.
        """
        for m in self._managers:
            m.check_integrity()
        first = self._first
        ids = set(first.sequence_ids())
        for g, m in enumerate(self._managers[1:], 1):
            if set(m.sequence_ids()) != ids:
                raise IntegrityError(f"group {g} holds other sequences than group 0")
            for seq_id in ids:
                if m.tokens(seq_id) != first.tokens(seq_id):
                    raise IntegrityError(f"group {g} holds other tokens for {seq_id!r}")
                if m.namespace(seq_id) != first.namespace(seq_id):
                    raise IntegrityError(f"group {g} holds {seq_id!r} in another namespace")
                if m.is_swapped(seq_id) != first.is_swapped(seq_id):
                    raise IntegrityError(f"group {g} disagrees whether {seq_id!r} is swapped")
                if m.speculation_start(seq_id) != first.speculation_start(seq_id):
                    raise IntegrityError(f"group {g} disagrees on {seq_id!r}'s speculation")

    def debug_state(self) -> tuple:
        """Every group's `debug_state()`: equal before and after a failed call."""
        return tuple(m.debug_state() for m in self._managers)

    # ------------------------------------------------------------- internals

    def _manager(self, group: int) -> BlockManager:
        if isinstance(group, bool) or not isinstance(group, int) or not (
            0 <= group < len(self._managers)
        ):
            raise InvalidArgument(f"no layer group {group!r} (have {len(self._managers)})")
        return self._managers[group]


def _merge_allocation(first: Allocation, more: Allocation) -> None:
    """Fold another group's allocation into group 0's: its ops follow, and
    the branch point is the furthest any group reports."""
    if more.ops:
        first.ops += more.ops
    branch_point = more.branch_point
    if branch_point is not None and (
        first.branch_point is None or branch_point > first.branch_point
    ):
        first.branch_point = branch_point


def _check_new_id(manager: BlockManager, seq_id: Hashable) -> None:
    try:
        exists = seq_id in manager
    except TypeError:
        raise InvalidArgument(f"sequence id must be hashable, got {seq_id!r}") from None
    if exists:
        raise DuplicateSequence(f"sequence {seq_id!r} is already live")


def _checked(tokens: Iterable[int], namespace: Hashable) -> tuple[list[int], bytes]:
    """The prompt checked once for every group: its ids as a list and packed
    (what each group's trie compares), and the namespace hashable."""
    check_hashable("namespace", namespace)
    return packed_prompt(tokens, "tokens")
