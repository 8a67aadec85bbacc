"""`GroupedStore`: the bookkeeping of every layer group of one model.

Real models mix layer kinds: full attention, sliding-window attention (one
group per distinct window) and recurrent layers (slots). Each group has its
own page pool; a `BlockManager` keeps them all alike (`blockmgr.page_group`),
with one prefix trie whose nodes hold a page list per group and one record
per sequence with a page table per group:

* every call has `BlockManager`'s meaning, and succeeds in every group or
  raises and changes nothing in any: the manager checks every group's pool
  before it changes one;
* `allocate`'s hit is the longest every group can serve (a sliding group
  needs its window's pages before the hit, a hybrid group a snapshot at
  it), found in one walk of the trie;
* page ops carry their group (`CopyBlock.group`, ...), slot ops need none.

`GroupedStore` is that manager built from a `GroupedStoreConfig` (the
groups named by their windows); `group_usage()` reads each group's pages.
"""

from __future__ import annotations

from blockmgr.config import GroupedStoreConfig
from blockmgr.errors import InvalidArgument
from blockmgr.manager import BlockManager
from blockmgr.trie_node import PrefixCacheListener


class GroupedStore(BlockManager):
    """Pages, slots and the prefix trie of all layer groups of one model.

    Not thread-safe. Group 0 is the config's first window (and keeps the
    recurrent slots); a request walks, locks, touches the LRU, inserts and
    records once for all groups, and each further group adds its page
    takes, references and window checks (`design/grouped_store.md`, "Costs").
    """

    config: GroupedStoreConfig

    def __init__(
        self, config: GroupedStoreConfig, listener: PrefixCacheListener | None = None
    ) -> None:
        """`listener` follows group 0's prefix cache (see `PrefixCacheListener`)."""
        if not isinstance(config, GroupedStoreConfig):
            raise InvalidArgument(f"config must be a GroupedStoreConfig, got {config!r}")
        super().__init__(config, listener)
