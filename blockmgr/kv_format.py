"""How pages store K and V rows, and what that costs in bytes: pure arithmetic.

A `KVFormat` says how each token's K row and V row are kept in pages: at
the model's dtype, or affine-quantized along the head dimension as mlx-lm's
``QuantizedKVCache`` keeps them (packed unsigned ints, one scale and one
bias per `group_size` elements), keys and values independently. The cache
(`cache.page_format`) builds its page pools from it; the simulator sizes a
simulated pool with it; both read `page_nbytes`, so a memory budget buys
the same page count in a simulation as in the engine.

Byte sizes as people write them (`parse_bytes`: "4GiB", "512MB") and as
they are shown (`format_bytes`) live here too: the cache's tier budgets,
`blockmgr serve --kv-memory` and the simulator all read them.

No MLX: a dtype is given by its bytes per element.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blockmgr.errors import InvalidArgument

#: Bits per quantized element (`mx.quantize`'s affine mode; both are exact
#: multiples of a 32-bit word for every allowed group size).
BITS = (4, 8)
#: Elements sharing one scale and bias (mlx-lm's `--kv-group-size` choices).
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64

_FIELDS = ("key_bits", "value_bits", "group_size")


@dataclass(frozen=True, slots=True)
class KVFormat:
    """The storage of K and V rows in pages.

    `key_bits` / `value_bits`: 8 or 4 for affine quantization along the head
    dimension in groups of `group_size` (32, 64 or 128) elements, each group
    with its own scale and bias in the model's dtype (mlx-lm's
    ``QuantizedKVCache`` format); None keeps that side at the model's dtype.
    ``KVFormat()`` is full-precision pages; ``KVFormat(8, 4)`` is 8-bit keys
    and 4-bit values. A quantized side needs a head size that `group_size`
    divides. Raises `InvalidArgument` for other values.

    Cost per token and kv head of a side of head size D at a dtype of s
    bytes: D * s bytes unquantized, D * bits / 8 + 2 * s * D / group_size
    quantized (float16, D = 128, groups of 64: 256 bytes; 136 at 8 bits,
    0.53x; 72 at 4 bits, 0.28x).
    """

    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if bits is not None and (isinstance(bits, bool) or bits not in BITS):
                raise InvalidArgument(f"{name} must be one of {BITS} or None, got {bits!r}")
        size = self.group_size
        if isinstance(size, bool) or size not in GROUP_SIZES:
            raise InvalidArgument(f"kv group size must be one of {GROUP_SIZES}, got {size!r}")

    @classmethod
    def of(cls, kv_format: KVFormat | None = None, kv_bits: int | None = None,
           kv_group_size: int | None = None) -> KVFormat:
        """The format of `PagedCache`'s options: `kv_format` as given, or
        `kv_bits` (keys and values alike, mlx-lm's ``--kv-bits``) with
        `kv_group_size` (default 64), or full precision when neither is
        given. Raises `InvalidArgument` for both, or a group size alone."""
        if kv_format is not None:
            if kv_bits is not None or kv_group_size is not None:
                raise InvalidArgument("give kv_format or kv_bits / kv_group_size, not both")
            if not isinstance(kv_format, KVFormat):
                raise InvalidArgument(f"kv_format must be a KVFormat, got {kv_format!r:.80}")
            return kv_format
        if kv_bits is None:
            if kv_group_size is not None:
                raise InvalidArgument("kv_group_size needs kv_bits")
            return cls()
        size = DEFAULT_GROUP_SIZE if kv_group_size is None else kv_group_size
        return cls(kv_bits, kv_bits, size)

    @property
    def quantized(self) -> bool:
        """Whether keys or values are quantized."""
        return self.key_bits is not None or self.value_bits is not None

    @property
    def name(self) -> str:
        """``"k8v4-g64"``, or ``"model-dtype"`` when nothing is quantized."""
        if not self.quantized:
            return "model-dtype"

        def side(bits: int | None) -> str:
            return "full" if bits is None else str(bits)

        return f"k{side(self.key_bits)}v{side(self.value_bits)}-g{self.group_size}"

    def row_nbytes(self, bits: int | None, head_dim: int, dtype_nbytes: int) -> int:
        """Bytes of one token's row of one kv head on a side with `bits`, at
        a model dtype of `dtype_nbytes` bytes per element. O(1)."""
        if bits is None:
            return head_dim * dtype_nbytes
        return head_dim * bits // 8 + 2 * (head_dim // self.group_size) * dtype_nbytes

    def page_nbytes(self, block_size: int, n_kv_heads: int, k_head_dim: int,
                    v_head_dim: int, dtype_nbytes: int) -> int:
        """Bytes of one page of one layer, K and V, every head, scales and
        biases included; exactly what a pool of this format allocates per
        page. O(1): nothing is allocated."""
        per_head = (self.row_nbytes(self.key_bits, k_head_dim, dtype_nbytes)
                    + self.row_nbytes(self.value_bits, v_head_dim, dtype_nbytes))
        return block_size * n_kv_heads * per_head

    def check_head_dims(self, layer: int | None, k_head_dim: int, v_head_dim: int) -> None:
        """Raise `InvalidArgument` (naming `layer`, unless None: every layer
        of a model shape) when a quantized side's head size is not a
        multiple of the group size (`mx.quantize` cannot store it). A side
        of width 0 stores nothing and always passes."""
        where = "" if layer is None else f"layer {layer}: "
        for side, bits, dim in (("key", self.key_bits, k_head_dim),
                                ("value", self.value_bits, v_head_dim)):
            if bits is not None and dim % self.group_size:
                raise InvalidArgument(
                    f"{where}{side} head size {dim} is not a multiple of the kv "
                    f"group size {self.group_size}; quantized pages need one that divides it "
                    f"(try a group size of {_dividing_group_size(dim)})")

    def to_dict(self) -> dict[str, Any]:
        """The three settings by name (a report's JSON)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: object) -> KVFormat:
        """Inverse of `to_dict` (missing keys take their defaults). Raises
        `InvalidArgument` for a non-mapping or an unknown key."""
        if not isinstance(data, Mapping):
            raise InvalidArgument("a kv format must be a JSON object")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise InvalidArgument(f"unknown kv format settings: {', '.join(map(str, unknown))} "
                                  f"(known: {', '.join(_FIELDS)})")
        return cls(**data)


def _dividing_group_size(dim: int) -> str:
    fits = [str(g) for g in GROUP_SIZES if dim and dim % g == 0]
    return " or ".join(fits) if fits else "none: keep this side unquantized (bits None)"


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12,
          "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """"4GiB", "512MB", "1e9" (or an int) -> bytes (binary units for
    Ki/Mi/Gi and bare K/M/G). Raises `InvalidArgument` for anything else
    or a size below 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidArgument(f"not a memory size: {text!r} (try 4GiB or 512MB)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise InvalidArgument(f"memory size must be positive, got {text!r}")
    return value


def format_bytes(num_bytes: int) -> str:
    """1536 -> "1.50 KiB" (binary units, as `parse_bytes` reads them)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} bytes"
