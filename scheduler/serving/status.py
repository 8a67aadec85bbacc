"""The server's periodic status line (vLLM's "Avg prompt throughput" line).

`StatusLine(interval)` is polled by the engine thread after every step and
on every idle wake-up (`AsyncEngine`); once `interval` seconds have passed
since the last line, and something ran since (or still runs), it returns

    running 3, waiting 1, KV 41.2% of 8012 pages, prefix hit 37.5%,
    prompt 812.4 tok/s, generation 96.3 tok/s

(requests running and waiting now; pages held by sequences and the prefix
cache over the pool; prompt tokens served from the prefix cache over
prompt tokens of the requests finished so far; prompt tokens computed and
tokens generated per second over the interval). An idle server writes
nothing. Cost: a few attribute reads per poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_number

#: `blockmgr serve --status-interval` default, in seconds (vLLM logs every 5 s).
DEFAULT_STATUS_INTERVAL = 10.0


@dataclass(slots=True)
class StatusLine:
    """See the module doc. `clock`: seconds (monotonic)."""

    interval: float
    clock: Callable[[], float] = time.monotonic
    _last_time: float = field(init=False, default=0.0)
    _last_prompt: int = field(init=False, default=0)
    _last_generated: int = field(init=False, default=0)
    _primed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.interval = check_number("status interval", self.interval)
        if not self.interval > 0:
            raise InvalidArgument(f"the status interval must be > 0 seconds, got {self.interval}")

    def poll(self, engine: Any, metrics: Any) -> str | None:
        """The status line if one is due (see the module doc), else None.
        The first poll only takes the engine's counters as the baseline
        (what ran before, a warm-up, is not reported)."""
        now = self.clock()
        stats, sched = engine.stats, engine.scheduler
        prompt, generated = stats.num_prefill_tokens, stats.num_generated_tokens
        if not self._primed:
            self._primed = True
            self._last_time, self._last_prompt, self._last_generated = now, prompt, generated
            return None
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return None
        busy = sched.num_running or sched.num_waiting
        if not busy and prompt == self._last_prompt and generated == self._last_generated:
            self._last_time = now  # idle: nothing to say
            return None
        line = format_status(engine, metrics, (prompt - self._last_prompt) / elapsed,
                             (generated - self._last_generated) / elapsed)
        self._last_time, self._last_prompt, self._last_generated = now, prompt, generated
        return line


def format_status(engine: Any, metrics: Any, prompt_rate: float, generation_rate: float) -> str:
    """One status line from the engine's state now and the rates given."""
    sched, cache = engine.scheduler, engine.cache
    total = cache.num_blocks
    hit = (metrics.num_cached_tokens / metrics.num_prompt_tokens
           if metrics.num_prompt_tokens else 0.0)
    return (f"running {sched.num_running}, waiting {sched.num_waiting}, "
            f"KV {100 * cache.usage:.1f}% of {total} pages, prefix hit {100 * hit:.1f}%, "
            f"prompt {prompt_rate:.1f} tok/s, generation {generation_rate:.1f} tok/s")
