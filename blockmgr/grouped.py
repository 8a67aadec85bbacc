"""`GroupedStore`: the bookkeeping of every layer group of one model.

Real models mix layer kinds: full attention, sliding-window attention (one
group per distinct window) and recurrent layers (slots). Each group has its
own page pool; one `BlockManager` keeps them all (group 0 as its own pages
and the recurrent slots, the others as further page groups,
`blockmgr.page_group`), with one prefix trie whose nodes hold a page list
per group and one record per sequence with a page table per group:

* every call has `BlockManager`'s meaning, and succeeds in every group or
  raises and changes nothing in any: the manager checks every group's pool
  before it changes one;
* `allocate`'s hit is the longest every group can serve (a sliding group
  needs its window's pages before the hit, a hybrid group a snapshot at
  it), found in one walk of the trie;
* page ops carry their group (`CopyBlock.group`, ...), slot ops need none.

The sequence calls are bound straight to the manager (no cost over a plain
`BlockManager` with one group).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

from blockmgr.config import GroupedStoreConfig
from blockmgr.errors import InvalidArgument
from blockmgr.manager import BlockManager
from blockmgr.ops import MemoryOp
from blockmgr.page_group import PageGroupView
from blockmgr.prefix_trie import PrefixCacheListener
from blockmgr.stats import PrefixCacheStats

Plan = tuple[MemoryOp, ...]

#: The calls the store binds straight to its manager.
_MANAGER_CALLS = (
    "can_allocate", "allocate", "cached_prefix_length", "can_append", "append",
    "can_append_decode", "append_decode", "fork",
    "can_truncate", "truncate", "cache_prefix", "free", "can_swap_out", "swap_out",
    "can_swap_in", "swap_in", "can_speculate", "begin_speculation", "commit_speculation",
    "abort_speculation", "shorten_speculation", "speculation_start", "recompute_from", "reset_prefix_cache",
    "take_listener_errors", "cached_paths",
)


class GroupedStore:
    """Pages, slots and prefix tries of all layer groups of one model.

    Not thread-safe. One `BlockManager` keeps every group: group 0 as its
    own, the others as further page groups (`blockmgr.page_group`) in the
    same trie nodes and sequence records, so each call walks, locks and
    records once; a further group adds its page takes, references and
    window checks (`design/grouped_store.md`, "Costs").
    """

    def __init__(
        self, config: GroupedStoreConfig, listener: PrefixCacheListener | None = None
    ) -> None:
        """`listener` follows group 0's prefix cache (see `PrefixCacheListener`)."""
        if not isinstance(config, GroupedStoreConfig):
            raise InvalidArgument(f"config must be a GroupedStoreConfig, got {config!r}")
        self.config = config
        self._first = BlockManager(
            config.group_config(0),
            listener,
            group=0,
            more_groups=tuple(config.group_config(g) for g in range(1, config.num_groups)),
        )
        self._managers = (
            self._first,
            *(PageGroupView(self._first, group) for group in self._first.page_groups),
        )
        # Every sequence call is the manager's (bound here, not wrapped).
        for name in _MANAGER_CALLS:
            setattr(self, name, getattr(self._first, name))

    # ------------------------------------------------------------- queries

    @property
    def managers(self) -> tuple[BlockManager, ...]:
        """Group 0's `BlockManager` (it keeps every group: its sequence calls
        are the store's), then a read-only `PageGroupView` per further group."""
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
        return self._first.block_table(seq_id, self._group_index(group))

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
        """Free pages of the group with the fewest (the binding one). O(groups):
        the scheduler reads it once per step."""
        if len(self._managers) == 1:
            return self._first.num_free_blocks
        return min(m.num_free_blocks for m in self._managers)

    @property
    def num_free_slots(self) -> int:
        return self._first.num_free_slots

    @property
    def num_cached_blocks(self) -> int:
        """Pages held by the prefix trie in all groups."""
        return sum(m.num_cached_blocks for m in self._managers)

    @property
    def usage(self) -> float:
        """Fraction of pages in use in the fullest group. O(groups): it is
        read once per simulated step."""
        if len(self._managers) == 1:
            return self._first.usage
        return max(m.usage for m in self._managers)

    @property
    def stats(self) -> PrefixCacheStats:
        """Queries, hits and the trie's nodes, with the pages (held, evicted)
        of every group summed. O(groups): it is read once per simulated step."""
        if len(self._managers) == 1:
            return self._first.stats  # a fresh record: nothing to sum
        per_group = [m.stats for m in self._managers]
        return replace(
            per_group[0],
            num_evicted_pages=sum(s.num_evicted_pages for s in per_group),
            num_trie_pages=sum(s.num_trie_pages for s in per_group),
        )

    @property
    def cache_version(self) -> int:
        """`BlockManager.cache_version` of the one trie of every group. O(1)."""
        return self._first.cache_version

    # -------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if any invariant is broken. O(state size).

        The manager's invariants (`design/blockmgr.md`) over every group: each
        sequence's page table per group covers its tokens, released pages
        first; page references (sequences and the trie's nodes, per group)
        match the pools; every trie node holds one page list per group,
        holes first (`design/grouped_store.md`).
        """
        self._first.check_integrity()

    def debug_state(self) -> tuple:
        """The manager's `debug_state()` (every group): equal before and after
        a failed call."""
        return self._first.debug_state()

    # ------------------------------------------------------------- internals

    def _group_index(self, group: int) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not (
            0 <= group < len(self._managers)
        ):
            raise InvalidArgument(f"no layer group {group!r} (have {len(self._managers)})")
        return group
