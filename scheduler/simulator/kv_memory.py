"""KV memory of a simulated pool: the pages a memory budget holds.

The engine sizes its pool from a KV memory budget (`blockmgr serve
--kv-memory`, `serve.size_pool`): a hybrid model's recurrent slots come off
first, then as many pages as fit, one page being a page of every attention
layer (of every layer group) in the page format (`cache.KVFormat`). A
simulation has no model, so `KVShape` states what those bytes depend on and
`KVMemory.num_blocks` gives the engine's page count:

    page = block_size x layers x kv_heads x (key row + value row)
    row  = head_dim x dtype bytes                                    model dtype
         = head_dim x bits / 8 + 2 x (head_dim / group_size) x dtype bytes   quantized

`KVFormat` (`blockmgr.kv_format`, pure arithmetic) prices a page exactly as
the cache does: the same object the engine builds its pools from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockmgr.errors import InvalidArgument, WrongArgumentType
from blockmgr.kv_format import KVFormat
from blockmgr.validation import check_choice, check_int

#: Bytes per element of the dtypes a model's K/V (and quantization scales) take.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def engine_num_slots(max_num_seqs: int) -> int:
    """The recurrent slots `blockmgr serve` gives a hybrid model's engine
    (`scheduler.engine.engine.default_num_slots`, without a draft model): each
    running sequence's state and a prefix snapshot, plus two."""
    return 2 * max_num_seqs + 2


@dataclass(frozen=True, slots=True)
class KVShape:
    """What a page's bytes depend on in the simulated model.

    num_layers: attention layers that hold pages (full and sliding), in the
        whole model (a page is one page of each).
    num_kv_heads, head_dim: per layer; v_head_dim: the values' (None: head_dim).
    dtype: the K/V dtype, a key of `DTYPE_BYTES`.
    slot_bytes: one recurrent slot over every recurrent layer (hybrid
        models; `blockmgr serve` prints it at start-up).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: str = "float16"
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("num_layers", 1), ("num_kv_heads", 1), ("head_dim", 1),
                              ("slot_bytes", 0)):
            check_int(f"kv shape {_KEYS[name]}", getattr(self, name), minimum, strict=True)
        if self.v_head_dim is not None:
            check_int("kv shape v_head_dim", self.v_head_dim, 1, strict=True)
        check_choice("kv shape dtype", self.dtype, DTYPE_BYTES)

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def to_dict(self) -> dict[str, Any]:
        """Keys as `--kv-shape` spells them."""
        return {_KEYS[name]: getattr(self, name) for name in _KEYS}

    @classmethod
    def from_dict(cls, data: Any) -> KVShape:
        """Inverse of `to_dict`; `layers`, `kv_heads` and `head_dim` are needed."""
        given = _known(data, "kv shape", tuple(_KEYS.values()))
        missing = [key for key in ("layers", "kv_heads", "head_dim") if key not in given]
        if missing:
            raise InvalidArgument(f"kv shape needs {', '.join(missing)} (e.g. "
                                  f"layers=28,kv_heads=8,head_dim=128,dtype=bfloat16)")
        names = {key: name for name, key in _KEYS.items()}
        return cls(**{names[key]: value for key, value in given.items()})


#: `KVShape` field -> its key in `--kv-shape` and in report.json.
_KEYS = {"num_layers": "layers", "num_kv_heads": "kv_heads", "head_dim": "head_dim",
         "v_head_dim": "v_head_dim", "dtype": "dtype", "slot_bytes": "slot_bytes"}


@dataclass(frozen=True, slots=True)
class KVMemory:
    """A KV memory `budget` (bytes) for a model of `shape` with pages in
    `format`. Raises `InvalidArgument` when a quantized side's head size is not
    a multiple of the group size (`mx.quantize` could not store it)."""

    budget: int
    shape: KVShape
    format: KVFormat = KVFormat()

    def __post_init__(self) -> None:
        check_int("kv memory budget", self.budget, 1, strict=True)
        if not isinstance(self.shape, KVShape) or not isinstance(self.format, KVFormat):
            raise WrongArgumentType("kv memory needs a KVShape and a KVFormat")
        self.format.check_head_dims(None, self.shape.head_dim, self.shape.value_head_dim)

    def page_bytes(self, block_size: int) -> int:
        """One page of every attention layer, K and V, scales and biases
        included: `KVFormat.page_nbytes` summed over the layers."""
        shape = self.shape
        return shape.num_layers * self.format.page_nbytes(
            block_size, shape.num_kv_heads, shape.head_dim, shape.value_head_dim,
            DTYPE_BYTES[shape.dtype])

    def num_blocks(self, block_size: int, num_slots: int) -> int:
        """Pages the budget holds after `num_slots` recurrent slots, as
        `serve.size_pool` counts them. Raises `InvalidArgument` when not even
        the slots and one page fit, or when slots are asked for with no
        `slot_bytes` (they would take no memory)."""
        if num_slots and not self.shape.slot_bytes:
            raise InvalidArgument("a hybrid pool's recurrent slots come off the KV memory first: "
                                  "give one slot's bytes (kv shape slot_bytes=N)")
        per_page = self.page_bytes(block_size)
        left = self.budget - num_slots * self.shape.slot_bytes
        if left < per_page:
            raise InvalidArgument(
                f"a KV memory of {self.budget} bytes does not hold {num_slots} recurrent slots "
                f"of {self.shape.slot_bytes} bytes and one page of {per_page} bytes")
        return left // per_page

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "format": self.format.to_dict(),
                "shape": self.shape.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> KVMemory:
        given = _known(data, "kv_memory", ("budget", "format", "shape"))
        if "budget" not in given or "shape" not in given:
            raise InvalidArgument("kv_memory needs a budget and a shape")
        return cls(budget=given["budget"], shape=KVShape.from_dict(given["shape"]),
                   format=KVFormat.from_dict(given.get("format", {})))


def _known(data: Any, what: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise InvalidArgument(f"unknown {what} settings: {', '.join(unknown)} "
                              f"(known: {', '.join(keys)})")
    return data
