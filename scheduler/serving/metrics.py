"""Serving metrics in Prometheus' text format (no client library needed).

`ServingMetrics` is updated by the engine thread (`observe_step` after each
step, `observe_finished` when a request ends) and rendered by
`render(engine)` for `/metrics`: gauges read from the engine at scrape time
(requests running / waiting, pages and slots used, prefix hit rate),
counters (requests by finish reason, prompt / generated / cached tokens,
preemptions, forward errors, rejected requests), histograms of time to
first token and time per output token, and `cache_config_info` (value 1,
the KV page format, page size and page count in its labels, as vLLM's
`cache_config_info`); with host or disk cache tiers, per tier
(`tier_families`): bytes, entries, hit tokens, loads and load time.
Metric names start with `blockmgr_`.

Beside them (`operator_families`): end-to-end and queue-time histograms,
requests refused by HTTP status (`count_refused`), and vLLM's names for the
load gauges a gateway reads (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and its older
spelling `vllm:gpu_cache_usage_perc`). With `model_name` set every sample
carries a `model_name` label, as vLLM's do. The KV usage gauges count the
pages the prefix cache holds as used (vLLM counts its evictable cached
blocks as free): the cache gives them back on demand.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: End-to-end and queue-time buckets (seconds): vLLM's request-latency buckets.
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics). O(log buckets)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            running += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out.append(f"{name}_sum {self.total!r}")
        out.append(f"{name}_count {self.count}")
        return out


@dataclass(slots=True)
class ServingMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    finished: Counter = field(default_factory=Counter)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_rejected: int = 0
    num_preemptions: int = 0
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    refused: Counter = field(default_factory=Counter)
    model_name: str | None = None

    def observe_step(self, engine: Any) -> None:
        stats = engine.scheduler.stats
        self.num_preemptions = stats.num_preempted_total

    def observe_finished(self, request: Any, out: Any) -> None:
        """A request ended (`out` is its final `RequestOutput`)."""
        metrics = request.metrics
        self.finished[out.status.value] += 1
        self.num_prompt_tokens += metrics.num_prompt_tokens
        self.num_cached_tokens += metrics.num_cached_tokens or 0
        self.num_generation_tokens += metrics.num_generated_tokens
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.time_per_output_token is not None:
            self.tpot.observe(metrics.time_per_output_token)
        self._observe_latencies(metrics)

    def _observe_latencies(self, metrics: Any) -> None:
        """End to end (arrival to finish) and queue time (arrival to first
        scheduled) of a finished request; a request never scheduled has no
        queue time."""
        if metrics.finish_time is not None:
            self.e2e.observe(metrics.finish_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue.observe(metrics.first_scheduled_time - metrics.arrival_time)

    def count_refused(self, status: int) -> None:
        """A request answered with error `status` before any output."""
        self.refused[status] += 1

    def render(self, engine: Any) -> str:
        """The whole exposition, one metric family after another."""
        sched, cache = engine.scheduler, engine.cache
        hit = self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        single = [  # (name, kind, help, value): one sample each
            ("requests_running", "gauge", "Sequences running.", sched.num_running),
            ("requests_waiting", "gauge", "Sequences waiting for admission.", sched.num_waiting),
            ("kv_pages_used", "gauge", "KV pages held (sequences and prefix cache).",
             cache.num_blocks - cache.num_free_blocks),
            ("kv_pages_total", "gauge", "KV pages in the pool.", cache.num_blocks),
            ("recurrent_slots_used", "gauge", "Recurrent-state slots held.",
             cache.num_slots - cache.num_free_slots),
            ("prefix_cache_hit_rate", "gauge",
             "Prompt tokens served from the prefix cache / prompt tokens (finished).", hit),
            ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
             self.num_prompt_tokens),
            ("cached_prompt_tokens_total", "counter", "Prompt tokens hit in the prefix cache.",
             self.num_cached_tokens),
            ("generation_tokens_total", "counter", "Generated tokens of finished requests.",
             self.num_generation_tokens),
            ("preemptions_total", "counter", "Sequences preempted.", self.num_preemptions),
            ("forward_errors_total", "counter", "Forward passes that raised.",
             engine.stats.num_forward_errors),
            ("requests_rejected_total", "counter", "Requests refused: the queue was full.",
             self.num_rejected),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in single:
            _family(lines, name, kind, help_text, [f"{name} {value!r}"])
        _family(lines, "cache_config_info", "gauge",  # as vLLM's cache_config_info
                "The KV cache's configuration in its labels: page format (model-dtype, or "
                "k<bits>v<bits>-g<group size>), tokens per page, pages.",
                [f'cache_config_info{{kv_format="{cache.kv_format.name}",'
                 f'block_size="{cache.block_size}",num_pages="{cache.num_blocks}"}} 1'])
        _family(lines, "requests_finished_total", "counter", "Requests finished, by reason.", [
            # dict() copies in one C call: the engine thread may add a reason meanwhile
            f'requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(
                dict(self.finished).items())])
        _family(lines, "time_to_first_token_seconds", "histogram", "Time to first token.",
                self.ttft.lines("time_to_first_token_seconds"))
        _family(lines, "time_per_output_token_seconds", "histogram", "Time per output token.",
                self.tpot.lines("time_per_output_token_seconds"))
        tier_families(lines, cache)
        lines.extend(self.operator_families(engine))
        if self.model_name is not None:
            lines = [_labelled(line, "model_name", self.model_name) for line in lines]
        return "\n".join(lines) + "\n"

    def operator_families(self, engine: Any) -> list[str]:
        """Latency histograms, refusals, and vLLM's load gauges (module doc)."""
        sched, cache = engine.scheduler, engine.cache
        lines: list[str] = []
        _family(lines, "e2e_request_latency_seconds", "histogram",
                "Arrival to finish of finished requests.",
                self.e2e.lines("e2e_request_latency_seconds"))
        _family(lines, "request_queue_time_seconds", "histogram",
                "Arrival to first scheduled of finished requests.",
                self.queue.lines("request_queue_time_seconds"))
        _family(lines, "requests_refused_total", "counter",
                "Completion requests answered with an error status, by status.", [
                    f'requests_refused_total{{status="{k}"}} {v}'
                    for k, v in sorted(dict(self.refused).items())])
        usage = cache.usage
        for name, kind, help_text, value in (
                ("num_requests_running", "gauge", "Sequences running.", sched.num_running),
                ("num_requests_waiting", "gauge", "Sequences waiting.", sched.num_waiting),
                ("kv_cache_usage_perc", "gauge", "KV pages used / pages (1 is full).", usage),
                ("gpu_cache_usage_perc", "gauge", "kv_cache_usage_perc (older name).", usage)):
            _family(lines, name, kind, help_text, [f"{name} {value!r}"], prefix="vllm:")
        return lines


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[str],
            prefix: str = "blockmgr_") -> None:
    lines.append(f"# HELP {prefix}{name} {help_text}")
    lines.append(f"# TYPE {prefix}{name} {kind}")
    lines.extend(f"{prefix}{s}" for s in samples)


def _labelled(line: str, label: str, value: str) -> str:
    """A sample line with `label="value"` first among its labels (comments
    unchanged). The value is escaped as Prometheus' text format asks."""
    if line.startswith("#"):
        return line
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    if "{" in line:
        name, rest = line.split("{", 1)
        return f'{name}{{{label}="{escaped}",{rest}'
    name, rest = line.split(" ", 1)
    return f'{name}{{{label}="{escaped}"}} {rest}'


#: (name, kind, help, the value of a `TierReport`): the prefix cache's tiers.
TIER_FAMILIES = (
    ("cache_tier_bytes", "gauge", "Bytes of cached pages and snapshots in each tier.",
     lambda r: r.num_bytes),
    ("cache_tier_entries", "gauge", "Cached prefix entries (trie nodes) in each tier.",
     lambda r: r.num_entries),
    ("cache_tier_hit_tokens_total", "counter",
     "Prompt tokens hit in the prefix cache, by the tier they were in.",
     lambda r: r.num_hit_tokens),
    ("cache_tier_loads_total", "counter",
     "Records (pages and snapshots) loaded from each tier to the device.",
     lambda r: r.num_loaded_records),
    ("cache_tier_load_seconds_total", "counter",
     "Seconds spent reading records loaded from each tier.", lambda r: r.load_seconds),
)


def tier_families(lines: list[str], cache: Any) -> None:
    """The prefix cache's tiers (design/tiers.md), one sample per tier
    (`tier="device"`, `"host"`, `"disk"`): nothing without colder tiers.
    O(trie nodes)."""
    reports = cache.tier_report()
    if not reports:
        return
    for name, kind, help_text, value in TIER_FAMILIES:
        _family(lines, name, kind, help_text, [
            f'{name}{{tier="{r.tier.name.lower()}"}} {value(r)!r}' for r in reports])

