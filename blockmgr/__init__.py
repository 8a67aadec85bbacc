"""Pure-Python bookkeeping of paged KV caches with recurrent slots.

No MLX here: the manager decides and returns memory-op plans
(`blockmgr.ops`) that the storage layers apply.
"""

from blockmgr.config import BlockManagerConfig
from blockmgr.errors import (
    BlockManagerError,
    DuplicateSequence,
    IntegrityError,
    InvalidArgument,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
    SequenceSwapped,
    UnknownSequence,
    WrongArgumentType,
)
from blockmgr.manager import BlockManager
from blockmgr.ops import (
    NO_OPS,
    CopyBlock,
    CopySlot,
    MemoryOp,
    SwapIn,
    SwapInSlot,
    SwapOut,
    SwapOutSlot,
    ZeroSlot,
)
from blockmgr.prefix_trie import PrefixCacheListener
from blockmgr.sequence import Allocation
from blockmgr.stats import PrefixCacheStats

__all__ = [
    "Allocation",
    "BlockManager",
    "BlockManagerConfig",
    "BlockManagerError",
    "CopyBlock",
    "CopySlot",
    "DuplicateSequence",
    "IntegrityError",
    "InvalidArgument",
    "MemoryOp",
    "NO_OPS",
    "NoSnapshot",
    "OutOfBlocks",
    "OutOfHostMemory",
    "OutOfSlots",
    "PrefixCacheListener",
    "PrefixCacheStats",
    "SequenceSwapped",
    "SwapIn",
    "SwapInSlot",
    "SwapOut",
    "SwapOutSlot",
    "UnknownSequence",
    "WrongArgumentType",
    "ZeroSlot",
]
