"""Recurrent-state storage on MLX for hybrid models (LFM2, Qwen3-Next, ...).

* `ops`: `causal_conv1d` and `gated_delta`, the two recurrences of these
  layers, in plain MLX with right-padding masks.
* `plan`: folds the block manager's `ZeroSlot`/`CopySlot` plans into one
  batched remap.
* `state_pool`: `StatePool`, one recurrent layer's state arrays, one row
  per slot.
* `batch`: `SlotBatch`, a validated batch of slots shared by all layers.
* `views`: `RecurrentView`, mlx-lm's `ArraysCache` protocol over a pool for
  one batch of slots.
* `host_slots`: `HostSlots`, host copies of one layer's slots (swap space).
* `pools`: `RecurrentPools`, the pools of all recurrent layers of a model.

Imports go one way: `recurrent` -> `blockmgr` (ops and errors only).
"""

from .batch import SlotBatch, make_batch
from .host_slots import HostSlots
from .ops import causal_conv1d, gated_delta, length_mask
from .plan import SlotRemap, compile_slot_plan
from .pools import RecurrentPools, is_recurrent_cache, probe_specs
from .state_pool import ArraySpec, StatePool
from .views import RecurrentView

__all__ = [
    "ArraySpec",
    "HostSlots",
    "RecurrentPools",
    "RecurrentView",
    "SlotBatch",
    "SlotRemap",
    "StatePool",
    "causal_conv1d",
    "compile_slot_plan",
    "gated_delta",
    "is_recurrent_cache",
    "length_mask",
    "make_batch",
    "probe_specs",
]
