"""Pure-Python bookkeeping of paged KV caches with recurrent slots.

No MLX here: the manager decides and returns memory-op plans
(`blockmgr.ops`) that the storage layers apply.
"""

from blockmgr.config import BlockManagerConfig, GroupedStoreConfig
from blockmgr.errors import (
    BlockManagerError,
    DuplicateSequence,
    IntegrityError,
    InvalidArgument,
    MemoryLeak,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
    SequenceSwapped,
    SpeculationInFlight,
    UnknownSequence,
    WrongArgumentType,
)
from blockmgr.grouped import GroupedStore
from blockmgr.kv_store import KVStore
from blockmgr.manager import BlockManager
from blockmgr.ops import (
    NO_OPS,
    CopyBlock,
    CopySlot,
    MemoryOp,
    MovePage,
    MoveSlot,
    Plan,
    SwapIn,
    SwapInSlot,
    SwapOut,
    SwapOutSlot,
    Tier,
    ZeroSlot,
)
from blockmgr.sequence import Allocation, Progress
from blockmgr.stats import PageGroupUsage, PrefixCacheStats
from blockmgr.tiered_trie import DiskEntry, TierCapacity, TieredTrie, TierUsage
from blockmgr.trie_node import PrefixCacheListener, PrefixMatch

__all__ = [
    "Allocation",
    "Progress",
    "BlockManager",
    "BlockManagerConfig",
    "BlockManagerError",
    "CopyBlock",
    "CopySlot",
    "DiskEntry",
    "DuplicateSequence",
    "GroupedStore",
    "GroupedStoreConfig",
    "IntegrityError",
    "InvalidArgument",
    "KVStore",
    "MemoryLeak",
    "MemoryOp",
    "MovePage",
    "MoveSlot",
    "NO_OPS",
    "NoSnapshot",
    "Plan",
    "OutOfBlocks",
    "OutOfHostMemory",
    "OutOfSlots",
    "PageGroupUsage",
    "PrefixCacheListener",
    "PrefixMatch",
    "PrefixCacheStats",
    "SequenceSwapped",
    "SpeculationInFlight",
    "SwapIn",
    "SwapInSlot",
    "SwapOut",
    "SwapOutSlot",
    "Tier",
    "TierCapacity",
    "TierUsage",
    "TieredTrie",
    "UnknownSequence",
    "WrongArgumentType",
    "ZeroSlot",
]
