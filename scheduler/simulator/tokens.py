"""Deterministic synthetic token text.

Every piece of text in a simulated workload (a system prompt, a user turn, a
tool output, a model output) is a `(key, length)` pair: the same pair always
expands to the same token ids, different keys to unrelated texts. This keeps
workloads and traces compact (a prompt is a few pairs, not thousands of ids)
and makes model outputs deterministic per request, so a multi-turn
conversation's next prompt can contain the previous answer verbatim.

Expansion slices a fixed random table (2**20 entries) at an offset taken from
the key and XORs a 15-bit salt, also from the key: two different keys give the
same text with probability 2**-35. Cost: O(length), a numpy slice, an
index into the shared int objects and `tolist()`, about 10 ns per token.
"""

from __future__ import annotations

import numpy as np

from blockmgr.validation import check_int

TABLE_BITS = 20
SALT_BITS = 15
_TABLE_SIZE = 1 << TABLE_BITS
#: The seed of the table's generator (`numpy.random.default_rng`): with
#: `TABLE_BITS` and `SALT_BITS`, what a text is recomputed from elsewhere.
TABLE_SEED = 0x5EED_B10C


#: Texts a `TokenSource` keeps expanded (those seen twice: shared system
#: prompts, a session's earlier turns), and sightings it remembers.
NUM_KEPT_TEXTS = 256
NUM_REMEMBERED_SIGHTINGS = 4096
#: Vocabularies up to this size get one shared int object per token id
#: (40 bytes an id: 10.5 MB at this size).
MAX_SHARED_IDS = 1 << 18


class TokenSource:
    """Expands `(key, length)` pairs into token ids in [0, vocab_size).

    A text asked for a second time is kept expanded (up to `NUM_KEPT_TEXTS`
    of them): a workload's few system prompts recur in most prompts, and a
    prompt's `tolist()` of Python ints is most of its expansion's cost.

    Every list holds the source's own int object of each id (up to
    `MAX_SHARED_IDS` ids; an object array indexed at C speed), not a fresh
    int per token: the same values, but the prompts and outputs of a run
    share a few thousand objects that stay in cache, instead of allocating
    one per token and freeing it, cold, when the prefix cache evicts the
    text thousands of requests later.
    """

    __slots__ = ("vocab_size", "_table", "_kept", "_seen", "_ids")

    def __init__(self, vocab_size: int = 32000) -> None:
        check_int("vocab_size", vocab_size, 2, strict=True)
        self.vocab_size = vocab_size
        rng = np.random.default_rng(TABLE_SEED)
        # Twice the size so any slice of length <= table size is contiguous.
        table = rng.integers(0, 1 << SALT_BITS, size=_TABLE_SIZE, dtype=np.int64)
        self._table = np.concatenate([table, table])
        self._kept: dict[tuple[int, int], list[int]] = {}
        self._seen: set[tuple[int, int]] = set()
        # id -> its int object (`astype(object)` makes Python ints); None: fresh ints.
        self._ids = np.arange(vocab_size).astype(object) if vocab_size <= MAX_SHARED_IDS else None

    def text(self, key: int, length: int) -> list[int]:
        """The `length` tokens of text `key`. O(length)."""
        if length <= 0:
            return []
        salted = self._salted(key, length)
        salted %= self.vocab_size  # in place: `_salted` returns a fresh array
        return self._as_list(salted)

    def expand(self, segments) -> list[int]:
        """Concatenate the texts of `(key, length)` segments. O(total length):
        a kept text is copied; each run of the others takes one numpy
        remainder and one `tolist`."""
        tokens: list[int] = []
        run: list[np.ndarray] = []  # salted slices not yet converted
        for key, length in segments:
            if length <= 0:
                continue
            kept = self._kept_text(key, length)
            if kept is None:
                run.append(self._salted(key, length))
                continue
            if run:
                tokens += self._converted(run)
                run = []
            tokens += kept
        if run:
            tokens += self._converted(run)
        return tokens

    def _kept_text(self, key: int, length: int) -> list[int] | None:
        """Text `(key, length)` if it is kept; kept from its second sighting
        on while there is room. The sightings remembered are bounded: past
        `NUM_REMEMBERED_SIGHTINGS` they are forgotten."""
        segment = (key, length)
        kept = self._kept.get(segment)
        if kept is not None or len(self._kept) >= NUM_KEPT_TEXTS:
            return kept
        if segment not in self._seen:
            if len(self._seen) >= NUM_REMEMBERED_SIGHTINGS:
                self._seen.clear()
            self._seen.add(segment)
            return None
        self._seen.discard(segment)
        kept = self._kept[segment] = self.text(key, length)
        return kept

    def _converted(self, run: list[np.ndarray]) -> list[int]:
        """Token ids of salted slices, in order: one remainder, one `tolist`."""
        salted = run[0] if len(run) == 1 else np.concatenate(run)
        salted %= self.vocab_size  # in place: every array of `run` is `_salted`'s own
        return self._as_list(salted)

    def _as_list(self, ids: np.ndarray) -> list[int]:
        """`ids.tolist()`, made of the shared int objects when there are some."""
        if self._ids is None:
            return ids.tolist()
        return self._ids[ids].tolist()

    def _salted(self, key: int, length: int) -> np.ndarray:
        """Text `key`'s table slice XOR its salt (`length` >= 1), before the
        remainder that maps it into the vocabulary: a new array, the
        caller's own."""
        offset = key & (_TABLE_SIZE - 1)
        salt = (key >> TABLE_BITS) & ((1 << SALT_BITS) - 1)
        if length <= _TABLE_SIZE:
            chunk = self._table[offset : offset + length]
        else:
            chunk = np.resize(np.roll(self._table[:_TABLE_SIZE], -offset), length)
        return chunk ^ salt


def derive_key(key: int, index: int) -> int:
    """A new key from `key` and a small index (e.g. sample i of a request).

    SplitMix64 finaliser: distinct (key, index) pairs give unrelated keys.
    """
    z = (key + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1  # 63 bits: fits JSON integers in every parser that matters
