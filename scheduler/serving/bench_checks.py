"""What a `blockmgr bench` run can say about its own validity.

`load_section(outcomes, time_scale)` is the report's `load` section:

* offered vs served rate of the open-loop session heads (those with an
  arrival time): offered = heads / the last head's (scaled) arrival, served
  = heads / the time the last-sent head got its first token (or ended).
  A server that keeps up serves them at the rate they come; one that falls
  behind queues them, and every latency of the run then measures the
  queue. `saturated` when served < `SATURATION_RATIO` x offered. Closed
  loop runs (no arrival times) have no offered rate: None.
* `first_request_cached_tokens`: the prompt tokens the server reported
  cached for the first request sent. Nothing this run sent was computed
  before it, so any hit means the server's cache was warm before the run
  (a rerun with the same seed measures a warm cache; `--fresh-cache` sends
  a new `cache_salt` each run, which this server and vLLM honour).

`load_warnings(load)` are the lines the report and the command print.
O(requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Served / offered below this flags the run as saturated.
SATURATION_RATIO = 0.9


def load_section(outcomes: Sequence[Any], time_scale: float) -> dict:
    """The `load` section of a bench summary (see the module doc)."""
    heads = [o for o in outcomes if o.spec.arrival is not None]
    offered = served = None
    if heads:
        span = max(o.spec.arrival for o in heads) * time_scale
        last = max(heads, key=lambda o: o.sent)
        done = last.first_token if last.first_token is not None else last.finish
        if span > 0 and done is not None and done > 0:
            offered, served = len(heads) / span, len(heads) / done
    first = min(outcomes, key=lambda o: o.sent, default=None)
    cached = None
    if first is not None and first.usage is not None:
        cached = (first.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "open_loop_sessions": len(heads),
        "offered_sessions_per_s": offered,
        "served_sessions_per_s": served,
        "saturated": offered is not None and served < SATURATION_RATIO * offered,
        "first_request_cached_tokens": cached,
    }


def load_warnings(load: dict) -> list[str]:
    """One line per problem the `load` section shows."""
    lines = []
    if load["saturated"]:
        lines.append(
            f"the server fell behind the offered rate: it served "
            f"{load['served_sessions_per_s']:.2f} of {load['offered_sessions_per_s']:.2f} "
            f"offered sessions/s, so the latencies measure its queue (lower --rate or "
            f"--time-scale up)")
    if load["first_request_cached_tokens"]:
        lines.append(
            f"the first request sent had {load['first_request_cached_tokens']} cached prompt "
            f"tokens: the server's prefix cache was warm before this run (a rerun with the same "
            f"seed?); the hit rate and the latencies are a warm cache's. Use another --seed, "
            f"--fresh-cache, or restart / reset the server's cache")
    return lines
