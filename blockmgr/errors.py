"""Typed errors of the block manager.

Every failing call leaves the manager exactly as it was before the call.
Bad arguments raise `InvalidArgument` (a `ValueError`); running out of memory
raises `OutOfBlocks` / `OutOfSlots`, which a scheduler catches to preempt.
"""

from __future__ import annotations


class BlockManagerError(Exception):
    """Base class of every error raised by `blockmgr`."""


class OutOfBlocks(BlockManagerError):
    """Not enough free KV pages, even after evicting the prefix cache."""


class OutOfSlots(BlockManagerError):
    """Not enough free recurrent-state slots, even after evicting snapshots."""


class UnknownSequence(BlockManagerError, KeyError):
    """No live sequence has this id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequence(BlockManagerError):
    """A live sequence already has this id."""


class SequenceSwapped(BlockManagerError):
    """The sequence is swapped out to host memory; swap it in first."""


class OutOfHostMemory(BlockManagerError):
    """Not enough host pages or slots to swap a sequence out."""


class InvalidArgument(BlockManagerError, ValueError):
    """An argument is out of range or of the wrong kind."""


class NoSnapshot(BlockManagerError):
    """Recurrent state cannot be rolled back: no snapshot exists at the target."""


class SpeculationInFlight(BlockManagerError):
    """The call cannot run while the sequence has a speculation transaction
    open (`begin_speculation`); commit or abort it first."""


class IntegrityError(BlockManagerError, AssertionError):
    """`check_integrity()` found a broken invariant: a bug, never a user error."""


class MemoryLeak(IntegrityError):
    """`check_no_leaks()` found memory held by something other than the
    prefix cache after every sequence ended: a bug, never a user error."""


class WrongArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong kind (a str where token ids belong, a float
    token id, an unhashable id): both an `InvalidArgument` and a `TypeError`."""
