"""`SchedulerConfig`: the scheduler's limits and policies, each declared
once with its default and its command-line help (`setting`)."""

from __future__ import annotations

from dataclasses import dataclass

from blockmgr.validation import check_bool, check_choice, check_int
from scheduler.core.policies import POLICIES, policy_named
from scheduler.core.settings import setting

#: What a preempted sequence loses: its pages (recomputed later) or its
#: place on the device (its pages copied to host memory and back).
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling limits and policies; validated on construction
    (`InvalidArgument`, a `ValueError`).

    max_num_batched_tokens: token budget of one step (prefill + decode).
    max_num_seqs: sequences running at once (a request with n samples
        counts n from admission on).
    policy: a name in `scheduler.core.policies.POLICIES`: "fcfs" (arrival
        order), "priority" (lower `Request.priority` first, then arrival) or
        "lpm" (longest cached prefix first).
    preemption: "recompute" or "swap" (falls back to recompute when host
        memory is short).
    long_prefill_token_threshold: cap on one sequence's prefill chunk per
        step, so concurrent prefills share the budget (None: no cap).
    max_num_partial_prefills: sequences that may be mid-prefill at once
        (None: no limit); admission waits while the limit is reached.
    checkpoint_prefill: snapshot every prefill chunk end into the prefix
        trie (`cache_prefix`), so concurrent and later requests hit it.
    max_model_len: a sample stops (FINISHED_LENGTH) when its sequence
        reaches this many tokens (None: what one sequence can hold in an
        empty store, `pool_length`, so no sequence outgrows the pool).
    """

    max_num_batched_tokens: int = setting(
        2048, "token budget of one step", metavar="TOKENS", minimum=1,
        old=("--max-batched-tokens",))
    max_num_seqs: int = setting(256, "sequences running at once", metavar="N", minimum=1)
    policy: str = setting(
        "fcfs", "waiting-queue order", choices=tuple(POLICIES),
        more="; ".join(f"{p.name}: {p.help}" for p in POLICIES.values()))
    preemption: str = setting("recompute", "what a preempted sequence loses",
                              choices=PREEMPTION_MODES)
    long_prefill_token_threshold: int | None = setting(
        None, "cap on one sequence's prefill chunk per step", none="none", metavar="TOKENS",
        minimum=1, old=("--long-prefill-threshold",))
    max_num_partial_prefills: int | None = setting(
        None, "sequences mid-prefill at once", none="no limit", metavar="N", minimum=1,
        old=("--max-partial-prefills",))
    checkpoint_prefill: bool = setting(
        True, "snapshot every prefill chunk end into the prefix cache")
    max_model_len: int | None = setting(
        None, "most prompt + output tokens of a sequence", none="what the pool holds",
        metavar="TOKENS", minimum=1)

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, strict=True)
        check_int("max_num_seqs", self.max_num_seqs, 1, strict=True)
        policy_named(self.policy)
        check_choice("preemption", self.preemption, PREEMPTION_MODES)
        for name, value in (
            ("long_prefill_token_threshold", self.long_prefill_token_threshold),
            ("max_num_partial_prefills", self.max_num_partial_prefills),
            ("max_model_len", self.max_model_len),
        ):
            if value is not None:
                check_int(name, value, 1, strict=True)
        check_bool("checkpoint_prefill", self.checkpoint_prefill)
