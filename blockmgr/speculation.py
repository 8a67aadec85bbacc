"""`SpeculationTransactions`: the speculation transaction of a `BlockManager`.

`begin_speculation` / `commit_speculation` / `abort_speculation` /
`shorten_speculation` (design/speculation.md, "The transaction"): a
sequence's token count at begin is recorded (`Speculation.start`), a hybrid
sequence's slot at begin is kept as a checkpoint while it writes a copy, and
a commit keeps part of the speculative tail, releasing the pages past it and
giving back the checkpoint when it keeps less than the whole tail.

The manager owns one `SpeculationTransactions` over its page groups, slot
pool and live sequences. Every call is a plan (pure, raising on a bad
argument) and an act on that plan (which cannot fail): the manager reserves
the plan's memory (with eviction) between the two and delivers the
prefix-cache events after the act; `can_speculate` is the same plan with
the manager's pure room check. `free` of a sequence with a transaction open
uses `check_free_count` and `end`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from blockmgr.errors import IntegrityError, InvalidArgument, WrongArgumentType
from blockmgr.growth import grow, plan_growth
from blockmgr.ops import CopySlot, MemoryOp, Plan
from blockmgr.page_group import PageGroup
from blockmgr.pool import RefCountedPool
from blockmgr.sequence import Sequence, SequenceTable, Speculation, held_page
from blockmgr.validation import check_count, check_int, token_list


@dataclass(frozen=True, slots=True)
class BeginPlan:
    """What `begin_speculation` does, checked whole before anything changes.

    entries: (sequence, draft tokens, recompute position) per sequence, in
    call order; needs: the pages to reserve in each page group (new pages,
    copies of shared last pages); num_slots: the slots to reserve (hybrid
    checkpoints and copies of shared slots).
    """

    entries: list[tuple[Sequence, list[int], int | None]]
    needs: list[int]
    num_slots: int


@dataclass(slots=True, eq=False)
class SpeculationTransactions:
    """Open and close speculation transactions on a manager's sequences.

    `groups` are the manager's page groups, `slots` its slot pool (None: no
    recurrent state), `sequences` its live sequences (the lookups raise its
    typed errors).
    """

    groups: tuple[PageGroup, ...]
    slots: RefCountedPool | None
    sequences: SequenceTable

    # ----------------------------------------------------------------- begin

    def plan_begin(
        self, drafts: object, num_computed: object
    ) -> BeginPlan:
        """Check `begin_speculation`'s arguments whole: (sequence, draft list,
        recompute position) per entry, pages and slots to reserve (copies of
        shared last pages and slots counted exactly: see `_num_copies`). Pure."""
        if not isinstance(drafts, Mapping):
            raise WrongArgumentType(f"drafts must be a mapping, got {drafts!r:.80}")
        if num_computed is None:
            num_computed = {}
        elif not isinstance(num_computed, Mapping):
            raise WrongArgumentType(f"num_computed must be a mapping, got {num_computed!r:.80}")
        elif not num_computed.keys() <= drafts.keys():
            raise InvalidArgument(
                f"num_computed names sequences without drafts: {num_computed!r:.80}"
            )
        entries = []
        num_pages = num_slots = 0
        # Shared last page (per group) / slot -> members of this call on it.
        shared_pages: list[Counter[int]] = [Counter() for _ in self.groups]
        shared_slots: Counter[int] = Counter()
        for seq_id, tokens in drafts.items():
            seq = self.sequences.idle(seq_id)
            tokens = token_list(tokens, f"drafts[{seq_id!r}]")
            growth = plan_growth(self.groups, self.slots, seq, len(tokens))
            num_pages += growth.num_pages
            num_slots += seq.slot is not None
            for index, copy in enumerate(growth.copies):
                if copy:
                    shared_pages[index][held_page(seq.tables[index][-1])] += 1
            if growth.copy_slot and seq.slot is not None:
                shared_slots[seq.slot] += 1
            entries.append((seq, tokens, self._recompute_position(seq, num_computed)))
        needs = [
            num_pages + _num_copies(shared, group.pages.refcount)
            for group, shared in zip(self.groups, shared_pages)
        ]
        if shared_slots:  # only a hybrid manager has slots
            num_slots += _num_copies(shared_slots, self._slot_pool.refcount)
        return BeginPlan(entries, needs, num_slots)

    def begin(self, plan: BeginPlan) -> Plan:
        """Open the transactions of `plan` (its memory is reserved); the
        plan of copies. O(sequences + draft pages)."""
        ops: list[MemoryOp] = []
        groups, slots = self.groups, self.slots
        for seq, tokens, recompute_from in plan.entries:
            # Asked now, not when planning: a sibling earlier in this call
            # may have moved off a page or slot they shared.
            growth = plan_growth(groups, slots, seq, len(tokens))
            copy_slot, growth.copy_slot = growth.copy_slot, False  # the checkpoint below
            grow(groups, slots, seq, growth, ops)
            checkpoint = source = seq.slot
            if source is not None:
                pool = self._slot_pool
                if copy_slot:
                    # Shared (a fork's sibling holds it too): a restore makes the
                    # sequence compute into its checkpoint, so it gets its own.
                    # Both copies read `source`, which the sibling keeps alive.
                    checkpoint = pool.take_one()
                    ops.append(CopySlot(source, checkpoint))
                    pool.release(source)
                working = seq.slot = pool.take_one()
                ops.append(CopySlot(source, working))
            seq.speculation = Speculation(len(seq.tokens), checkpoint, recompute_from)
            seq.recompute_hold = False  # the transaction holds it
            seq.tokens.extend(tokens)
        return tuple(ops)

    def _recompute_position(
        self, seq: Sequence, num_computed: Mapping[Hashable, object]
    ) -> int | None:
        """Where a partial commit of `seq` recomputes from (checked: its
        window's pages are held), or None."""
        seq_id = seq.seq_id
        if seq_id not in num_computed:
            if seq.recompute_hold:
                return seq.num_computed
            return None if seq.slot is None else len(seq.tokens)
        position = check_int(f"num_computed[{seq_id!r}]", num_computed[seq_id], 0, len(seq.tokens))
        if not all(group.window_keeps(seq, position) for group in self.groups):
            raise InvalidArgument(
                f"cannot speculate on {seq_id!r} from {position} computed tokens: "
                "pages its window needs were already released"
            )
        return position

    # ---------------------------------------------------------- commit/shorten

    def plan_commit(self, accepted: object) -> list[tuple[Sequence, Speculation, int]]:
        """Check `commit_speculation`'s (or `shorten_speculation`'s) argument
        whole: (sequence, its transaction, speculative tokens kept) per
        entry. Pure."""
        if not isinstance(accepted, Mapping):
            raise WrongArgumentType(f"accepted must be a mapping, got {accepted!r:.80}")
        plan = []
        live = self.sequences.live
        for seq_id, num in accepted.items():
            seq = live(seq_id)
            spec = seq.speculation
            if spec is None:
                raise InvalidArgument(f"sequence {seq_id!r} has no speculation open")
            kept = check_int(f"accepted[{seq_id!r}]", num, 0, len(seq.tokens) - spec.start)
            plan.append((seq, spec, kept))
        return plan

    def commit(self, plan: list[tuple[Sequence, Speculation, int]]) -> frozenset[Hashable]:
        """Close the transactions of `plan`; the ids of the sequences whose
        checkpoint came back."""
        return frozenset(seq.seq_id for seq, spec, num in plan if self.end(seq, spec, num))

    def shorten(self, plan: list[tuple[Sequence, Speculation, int]]) -> None:
        """Drop the speculative tokens past each entry's kept count; the
        transactions stay open."""
        for seq, spec, num in plan:
            self._drop_tail(seq, spec.start + num)

    def end(self, seq: Sequence, spec: Speculation, num_accepted: int) -> bool:
        """Close `seq`'s open transaction `spec` keeping `num_accepted`
        speculative tokens; True when the checkpoint came back. Cannot fail
        (the caller checked)."""
        seq.speculation = None
        end = spec.start + num_accepted
        num_tokens = len(seq.tokens)
        restored = spec.checkpoint is not None and end < num_tokens
        if spec.checkpoint is not None and seq.slot is not None:
            keep, drop = (spec.checkpoint, seq.slot) if restored else (seq.slot, spec.checkpoint)
            seq.slot = keep
            self._slot_pool.release(drop)
        self._drop_tail(seq, end)
        recompute = spec.recompute_from
        if recompute is not None and (restored or (end < num_tokens and recompute < end)):
            # Computed again from there (a restored checkpoint's state is for
            # it): the count goes back, and the windows hold what it attends to.
            seq.num_computed = recompute
            seq.recompute_hold = recompute < end
        # No window release here: the next append releases from its first
        # token to compute.
        return restored

    @staticmethod
    def check_free_count(seq: Sequence, spec: Speculation, num_computed: object) -> None:
        """`free`'s count for a sequence with transaction `spec` open: at most
        the tokens before the drafts."""
        if num_computed is not None and check_count("num_computed", num_computed) > spec.start:
            raise InvalidArgument(
                f"{seq.seq_id!r} has {spec.start} tokens before its drafts, not {num_computed}"
            )

    @property
    def _slot_pool(self) -> RefCountedPool:
        """The slot pool (a hybrid manager's; the slot paths run only there)."""
        if self.slots is None:
            raise IntegrityError("a manager without recurrent slots was asked for one")
        return self.slots

    def _drop_tail(self, seq: Sequence, end: int) -> None:
        """Keep the sequence's first `end` tokens (inside its speculative
        tail) and release the pages past them."""
        keep_pages = -(-end // self.groups[0].block_size)
        for group in self.groups:
            group.keep_pages(seq, keep_pages)
        del seq.tokens[end:]
        if seq.num_computed > end:
            seq.num_computed = end


def _num_copies(members: Counter[int], refcount: Callable[[int], int]) -> int:
    """Copies that give each of `members[i]` sequences holding id `i` its
    own, in turn: all of them when someone outside the call holds `i` too,
    else all but the last (it is then the sole owner)."""
    return sum(m if refcount(i) > m else m - 1 for i, m in members.items())
