"""A pool of refcounted ids: KV pages and recurrent-state slots both use it.

The free ids sit on a stack (a Python list), the refcounts in a list indexed
by id, so taking and releasing an id is O(1) and creates no Python objects
beyond the returned list. The pool does not know what an id stands for; the
manager decides what storage work (copy, zero) a fresh id needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from blockmgr.errors import IntegrityError, InvalidArgument


class RefCountedPool:
    """`num_items` ids, each free (refcount 0) or held by `refcount` owners.

    Ids come out lowest first on a fresh pool; a released id is the next one
    handed out (LIFO), which keeps the working set of pages small.
    """

    __slots__ = ("_refcounts", "_free", "_num_items")

    def __init__(self, num_items: int) -> None:
        if num_items < 0:
            raise InvalidArgument(f"num_items must be >= 0, got {num_items}")
        self._num_items = num_items
        self._refcounts = [0] * num_items
        self._free = list(range(num_items - 1, -1, -1))

    @property
    def num_items(self) -> int:
        return self._num_items

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_items - len(self._free)

    def refcount(self, item: int) -> int:
        return self._refcounts[item]

    def live_refcounts(self) -> Sequence[int]:
        """The pool's refcount of every id, the list itself (not a copy), for
        loops that run once per decoded token: a read is an index, not a
        call. Read only (the pool alone writes it); valid for the pool's
        life (the list is never replaced, and a deep copy or pickle of an
        owner that holds it keeps it the copied pool's). O(1)."""
        return self._refcounts

    def can_take(self, num_items: int) -> bool:
        return num_items <= len(self._free)

    def take(self, num_items: int) -> list[int]:
        """Hand out `num_items` free ids with refcount 1. O(num_items).

        The caller checks `can_take` first; taking more than is free raises
        `ValueError` and changes nothing.
        """
        free = self._free
        if num_items > len(free):
            raise InvalidArgument(f"asked for {num_items} ids, {len(free)} free")
        if num_items == 0:
            return []
        items = free[-num_items:]
        del free[-num_items:]
        items.reverse()
        refcounts = self._refcounts
        for item in items:
            refcounts[item] = 1
        return items

    def take_one(self) -> int:
        """Hand out one free id with refcount 1. O(1)."""
        item = self._free.pop()
        self._refcounts[item] = 1
        return item

    def claim(self, items: Iterable[int]) -> None:
        """One more reference to each of `items`, free or not (rebuilding a
        holder's references after a restart); the free list keeps its order
        for the rest. The caller checks the ids are in range. O(num_items)."""
        refcounts = self._refcounts
        newly_held = set()
        for item in items:
            if refcounts[item] == 0:
                newly_held.add(item)
            refcounts[item] += 1
        if newly_held:
            self._free = [item for item in self._free if item not in newly_held]

    def incref(self, item: int) -> None:
        self._refcounts[item] += 1

    def incref_all(self, items: Iterable[int]) -> None:
        refcounts = self._refcounts
        for item in items:
            refcounts[item] += 1

    def release(self, item: int) -> bool:
        """Drop one reference; return True when the id became free. O(1)."""
        refcounts = self._refcounts
        count = refcounts[item] - 1
        refcounts[item] = count
        if count == 0:
            self._free.append(item)
            return True
        return False

    def release_all(self, items: Iterable[int]) -> int:
        """Drop one reference to each id; return how many became free."""
        refcounts = self._refcounts
        free = self._free
        num_freed = 0
        for item in items:
            count = refcounts[item] - 1
            refcounts[item] = count
            if count == 0:
                free.append(item)
                num_freed += 1
        return num_freed

    def num_sole(self, items: Iterable[int]) -> int:
        """How many distinct ids of `items` have exactly one reference. Pure;
        O(len(items))."""
        refcounts = self._refcounts
        return len({item for item in items if refcounts[item] == 1})

    def tally_release(self, items: Iterable[int], pending: dict[int, int]) -> int:
        """Count one more planned release of each id of `items` in `pending`
        (id -> planned releases, the caller's tally); return how many ids that
        brings to their refcount, i.e. would become free. The pool does not
        change; O(len(items))."""
        refcounts = self._refcounts
        num_freed = 0
        for item in items:
            count = pending.get(item, 0) + 1
            pending[item] = count
            if count == refcounts[item]:
                num_freed += 1
        return num_freed

    def free_items(self) -> list[int]:
        """The free ids, in the order they will be handed out last-to-first."""
        return list(self._free)

    def refcounts(self) -> list[int]:
        return list(self._refcounts)

    def check_integrity(self, expected_refcounts: list[int], what: str) -> None:
        """Raise `IntegrityError` unless refcounts equal the references held.

        `expected_refcounts[i]` counts the references the caller found to id i.
        """
        if self._refcounts != expected_refcounts:
            wrong = [
                (i, have, want)
                for i, (have, want) in enumerate(zip(self._refcounts, expected_refcounts))
                if have != want
            ]
            raise IntegrityError(f"{what} refcounts differ (id, have, expected): {wrong[:10]}")
        free = self._free
        if len(set(free)) != len(free):
            raise IntegrityError(f"a {what} id is on the free list twice")
        refcounts = self._refcounts
        if any(map(refcounts.__getitem__, free)):  # at C speed; the loop names the id
            for item in free:
                if refcounts[item] != 0:
                    raise IntegrityError(f"{what} {item} is free but referenced")
        num_zero = refcounts.count(0)
        if num_zero != len(free):
            raise IntegrityError(
                f"{num_zero} {what}s have refcount 0 but {len(free)} are on the free list"
            )
