"""`EngineStats`: an engine's counters and timings over its life."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    """Counters and timings (seconds) over the engine's life.

    peak_kv_bytes: most KV page bytes held at once (sequences + prefix trie);
    peak_state_bytes: likewise for recurrent slots;
    num_forward_errors: forwards that raised (rolled back and retried);
    num_draft_tokens / num_accepted_tokens / num_draft_forwards /
    num_recomputed_tokens: speculative decoding (`acceptance_rate`; tokens
    computed again after a hybrid checkpoint restore); `num_forwards`
    counts the target's only.
    """

    num_steps: int = 0
    num_forwards: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    schedule_time: float = 0.0
    forward_time: float = 0.0
    peak_kv_bytes: int = 0
    peak_state_bytes: int = 0
    num_forward_errors: int = 0
    step_times: list[float] = field(default_factory=list)
    num_draft_tokens: int = 0  # speculative decoding: tokens the draft proposed
    num_accepted_tokens: int = 0  # ... and the target accepted
    num_draft_forwards: int = 0
    num_recomputed_tokens: int = 0  # pending again after a hybrid checkpoint restore

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens
