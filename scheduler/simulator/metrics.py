"""Metrics of a simulation: per-step timeline, per-request records, summary.

`MetricsRecorder` is fed by the runner (one `on_step` per scheduler step, one
`on_finish` per finished request, a memory snapshot every few steps) and
turns it into the summary dict of the report. Recording is O(1) per step and
per request (plain Python arrays); the summary is O(steps + requests) numpy.

Simulated times are seconds of the cost model's clock; `bookkeeping` figures
are real (wall-clock) seconds spent in the scheduler and block manager.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass

import numpy as np

from scheduler.simulator.group_usage import GroupUsage
from scheduler.simulator.memory import MemorySnapshot

PERCENTILES = (50, 90, 99)

#: Per-step series (one value per scheduler step), in recording order.
STEP_FIELDS = (
    "time",  # simulated time at the end of the step
    "step_time",  # simulated duration of the step
    "prefill_tokens",
    "decode_tokens",
    "waiting",  # requests' sequences waiting (incl. preempted) after scheduling
    "running",
    "page_usage",  # fraction of pages used by sequences or the trie
    "trie_pages",  # pages held by the prefix trie (some shared with sequences)
    "trie_nodes",
    "slots_used",  # recurrent slots in use (hybrid), sequences + trie
    "preempted_recompute",  # cumulative
    "preempted_swap",  # cumulative
    "query_tokens",  # cumulative prompt tokens asked of the prefix cache
    "hit_tokens",  # cumulative prompt tokens served by it
    "finished",  # cumulative finished requests
    "bookkeeping",  # real seconds in schedule() + update()
)

#: Memory series (one value per snapshot).
MEMORY_FIELDS = (
    "time",
    "fragmentation",
    "sharing_saved",
    "logical_pages",
    "physical_pages",
    "contiguous_tokens",
    "tokens",
)

#: Per-request series (one value per finished request).
REQUEST_FIELDS = (
    "arrival",
    "ttft",
    "tpot",  # per sample; NaN with fewer than 2 output tokens per sample
    "e2e",
    "queue",  # first scheduled - arrival
    "max_gap",
    "prompt_tokens",
    "cached_tokens",  # prefix hit at first admission
    "output_tokens",
    "computed_tokens",
    "preemptions",
)


@dataclass(slots=True)
class RequestRecord:
    """What the runner reports for one finished request (simulated seconds)."""

    workload: str
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    finish: float
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    computed_tokens: int
    preemptions: int
    max_gap: float
    samples: int = 1
    aborted: bool = False
    abort_reason: str | None = None  # why an aborted request was (the report counts them)

    @classmethod
    def of(cls, workload: str, request, now: float, aborted: bool,
           abort_reason: str | None = None) -> "RequestRecord":
        """The record of a finished or aborted scheduler `Request` (`now`
        stands in for a missing finish time)."""
        m = request.metrics
        return cls(
            workload=workload,
            arrival=m.arrival_time,
            first_scheduled=m.first_scheduled_time,
            first_token=m.first_token_time,
            last_token=m.last_token_time,
            finish=m.finish_time if m.finish_time is not None else now,
            prompt_tokens=len(request.prompt_tokens),
            cached_tokens=m.num_cached_tokens,
            output_tokens=m.num_generated_tokens,
            computed_tokens=m.num_computed_tokens,
            preemptions=m.num_preemptions,
            max_gap=m.max_token_gap,
            samples=request.sampling.n,
            aborted=aborted,
            abort_reason=abort_reason,
        )


class MetricsRecorder:
    """Accumulates series; `summary()` reduces them."""

    def __init__(self) -> None:
        self._steps = array("d")  # STEP_FIELDS values of every step, step after step
        self.memory = {name: array("d") for name in MEMORY_FIELDS}
        self.requests = {name: array("d") for name in REQUEST_FIELDS}
        self.workloads: list[str] = []
        self.num_aborted = 0
        self.num_integrity_checks = 0
        self.peak_pages_used = 0
        self.peak_memory: MemorySnapshot | None = None
        self.groups = GroupUsage()
        self.abort_reasons: Counter[str] = Counter()

    # ------------------------------------------------------------ recording

    def on_step(self, values: tuple) -> None:
        """One value per `STEP_FIELDS` entry, in that order. O(1): one flat
        array, not a series per field (this runs once per simulated step)."""
        self._steps.extend(values)

    def on_scheduler_step(self, now: float, dt: float, out, bm, sched, num_slots: int,
                          num_done: int, bookkeeping: float) -> None:
        """One step of a `Scheduler` over block manager `bm` (its counters
        after the step's update). O(1)."""
        stats, sstats = bm.stats, sched.stats
        self.on_step((
            now, dt, out.num_prefill_tokens, out.num_decode_tokens,
            sched.num_waiting, sched.num_running, bm.usage,
            stats.num_trie_pages, stats.num_trie_nodes,
            num_slots - bm.num_free_slots,
            sstats.num_preempted_recompute_total, sstats.num_preempted_swap_total,
            stats.num_query_tokens, stats.num_hit_tokens, num_done, bookkeeping,
        ))
        self.groups.observe(bm)

    def on_memory(self, time: float, snap: MemorySnapshot) -> None:
        mem = self.memory
        mem["time"].append(time)
        mem["fragmentation"].append(snap.fragmentation)
        mem["sharing_saved"].append(snap.sharing_saved_fraction)
        mem["logical_pages"].append(snap.logical_pages)
        mem["physical_pages"].append(snap.physical_pages)
        mem["contiguous_tokens"].append(snap.contiguous_tokens)
        mem["tokens"].append(snap.tokens)
        if self.peak_memory is None or snap.physical_pages > self.peak_memory.physical_pages:
            self.peak_memory = snap

    def on_finish(self, rec: RequestRecord) -> None:
        if rec.aborted:
            self.num_aborted += 1
            self.abort_reasons[rec.abort_reason or "unspecified"] += 1
            return
        r = self.requests
        first = rec.first_token if rec.first_token is not None else rec.finish
        r["arrival"].append(rec.arrival)
        r["ttft"].append(first - rec.arrival)
        per_sample = rec.output_tokens / rec.samples  # samples decode side by side
        if per_sample >= 2 and rec.last_token is not None:
            r["tpot"].append((rec.last_token - first) / (per_sample - 1))
        else:
            r["tpot"].append(float("nan"))
        r["e2e"].append(rec.finish - rec.arrival)
        scheduled = rec.first_scheduled if rec.first_scheduled is not None else first
        r["queue"].append(scheduled - rec.arrival)
        r["max_gap"].append(rec.max_gap)
        r["prompt_tokens"].append(rec.prompt_tokens)
        r["cached_tokens"].append(rec.cached_tokens or 0)
        r["output_tokens"].append(rec.output_tokens)
        r["computed_tokens"].append(rec.computed_tokens)
        r["preemptions"].append(rec.preemptions)
        self.workloads.append(rec.workload)

    # ------------------------------------------------------------- reducing

    def step_arrays(self) -> dict[str, np.ndarray]:
        table = np.frombuffer(self._steps, dtype=np.float64) if len(self._steps) else np.zeros(0)
        table = table.reshape(-1, len(STEP_FIELDS))
        return {name: table[:, i].copy() for i, name in enumerate(STEP_FIELDS)}

    def memory_arrays(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(series, dtype=np.float64) if len(series) else np.zeros(0)
                for name, series in self.memory.items()}

    def request_arrays(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(series, dtype=np.float64) if len(series) else np.zeros(0)
                for name, series in self.requests.items()}

    def summary(
        self, *, num_blocks: int, block_size: int, num_slots: int, bm_stats, wall_seconds: float
    ) -> dict:
        """Every metric of the run as a JSON-ready dict (see design/simulator.md)."""
        steps = self.step_arrays()
        mem = self.memory_arrays()
        req = self.request_arrays()
        num_done = len(req["arrival"])
        start = float(req["arrival"].min()) if num_done else 0.0
        end = float(steps["time"][-1]) if len(steps["time"]) else 0.0
        makespan = max(end - start, 0.0)
        computed = float(steps["prefill_tokens"].sum() + steps["decode_tokens"].sum())
        requests, throughput, latency = self.request_sections(makespan, "simulated_seconds")
        throughput["computed_tokens_per_s"] = _rate(computed, makespan)
        return {
            "requests": requests,
            "throughput": throughput,
            "latency": latency,
            "prefix_cache": _prefix(bm_stats, req),
            "memory": {**self._memory(steps, mem, num_blocks, block_size),
                       "groups": self.groups.summary(steps["step_time"])},
            "slots": _slots(steps, num_slots, bm_stats),
            "preemptions": {
                "recompute": int(_last(steps["preempted_recompute"])),
                "swap": int(_last(steps["preempted_swap"])),
                "total": int(_last(steps["preempted_recompute"]) + _last(steps["preempted_swap"])),
                "requests_preempted": int(np.count_nonzero(req["preemptions"])),
                "recomputed_tokens": int(max(computed - _useful(req), 0)),
            },
            "evictions": {
                "pages": bm_stats.num_evicted_pages,
                "nodes": bm_stats.num_evicted_nodes,
            },
            "trie": {
                "nodes_final": bm_stats.num_trie_nodes,
                "pages_final": bm_stats.num_trie_pages,
                "slots_final": bm_stats.num_trie_slots,
                "nodes_peak": int(_max(steps["trie_nodes"])),
                "pages_peak": int(_max(steps["trie_pages"])),
            },
            "steps": {
                "count": len(steps["time"]),
                "mean_step_time_s": _mean(steps["step_time"]),
                "mean_batch_tokens": _mean(steps["prefill_tokens"] + steps["decode_tokens"]),
                "mean_running": _mean(steps["running"]),
                "mean_waiting": _mean(steps["waiting"]),
                "max_waiting": int(_max(steps["waiting"])),
            },
            "bookkeeping": _bookkeeping(steps["bookkeeping"], num_done, wall_seconds),
        }

    def request_sections(self, seconds: float, seconds_key: str) -> tuple[dict, dict, dict]:
        """The `requests`, `throughput` and `latency` sections of `summary()`
        over `seconds` of run time. O(requests)."""
        req = self.request_arrays()
        requests, throughput = self._counts(req, seconds, seconds_key)
        return requests, throughput, {**_latency(req), "queue_s": _dist(req["queue"])}

    @classmethod
    def merged(cls, recorders: "list[MetricsRecorder]") -> "MetricsRecorder":
        """One recorder holding the finished and aborted requests of all of
        `recorders`, in their order (no steps, no memory snapshots): a
        fleet's requests. O(requests)."""
        out = cls()
        for rec in recorders:
            for name, series in rec.requests.items():
                out.requests[name].extend(series)
            out.workloads.extend(rec.workloads)
            out.num_aborted += rec.num_aborted
            out.abort_reasons.update(rec.abort_reasons)
        return out

    def request_summary(self, seconds: float) -> dict:
        """The request-side sections of `summary()` (requests, throughput,
        latency, the first-admission prefix hit) over `seconds` of run time,
        for runs that see only requests (a load generator against a server).
        O(requests)."""
        req = self.request_arrays()
        prompt_tokens = float(req["prompt_tokens"].sum())
        cached = float(req["cached_tokens"].sum())
        requests, throughput = self._counts(req, seconds, "seconds")
        return {
            "requests": requests,
            "throughput": throughput,
            "latency": _latency(req),
            "prefix_cache": {
                "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
                "first_admission_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
                "hit_tokens": int(cached),
                "query_tokens": int(prompt_tokens),
            },
        }

    def _counts(self, req, seconds: float, seconds_key: str) -> tuple[dict, dict]:
        """The `requests` and `throughput` sections over `seconds`."""
        num_done = len(req["arrival"])
        out_tokens = float(req["output_tokens"].sum())
        prompt_tokens = float(req["prompt_tokens"].sum())
        requests = {
            "finished": num_done,
            "aborted": self.num_aborted,
            "abort_reasons": dict(self.abort_reasons.most_common()),
            "by_workload": self._by_workload(req),
            "prompt_tokens": int(prompt_tokens),
            "output_tokens": int(out_tokens),
        }
        throughput = {
            seconds_key: seconds,
            "requests_per_s": _rate(num_done, seconds),
            "output_tokens_per_s": _rate(out_tokens, seconds),
            "prompt_tokens_per_s": _rate(prompt_tokens, seconds),
        }
        return requests, throughput

    def _by_workload(self, req) -> dict[str, dict]:
        """Per workload kind: requests, first-admission hit rate, TTFT and e2e."""
        names = np.array(self.workloads, dtype=object)
        out = {}
        for kind in sorted(set(self.workloads)):
            mask = names == kind
            prompt = float(req["prompt_tokens"][mask].sum())
            ttft = req["ttft"][mask]
            e2e = req["e2e"][mask]
            out[kind] = {
                "requests": int(mask.sum()),
                "first_admission_hit_rate": float(req["cached_tokens"][mask].sum()) / prompt
                if prompt else 0.0,
                "mean_prompt_tokens": prompt / int(mask.sum()),
                "ttft_p50_s": float(np.percentile(ttft, 50)),
                "ttft_p99_s": float(np.percentile(ttft, 99)),
                "e2e_p50_s": float(np.percentile(e2e, 50)),
            }
        return out

    def _memory(self, steps, mem, num_blocks: int, block_size: int) -> dict:
        usage = steps["page_usage"]
        weights = steps["step_time"]
        peak = self.peak_memory
        contiguous = mem["contiguous_tokens"]
        paged = mem["physical_pages"] * block_size
        ratio = paged.sum() / contiguous.sum() if contiguous.sum() else None
        return {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "page_usage_peak": _max(usage),
            "page_usage_mean": float(np.average(usage, weights=weights)) if weights.sum() else 0.0,
            "pages_used_peak": int(round(_max(usage) * num_blocks)),
            "sequence_pages_peak": int(_max(mem["physical_pages"])),
            "fragmentation_mean": _mean(mem["fragmentation"]),
            "fragmentation_peak": _max(mem["fragmentation"]),
            "sharing_saved_mean": _mean(mem["sharing_saved"]),
            "sharing_saved_peak": _max(mem["sharing_saved"]),
            "sharing_saved_pages_peak": int(_max(mem["logical_pages"] - mem["physical_pages"])),
            "paged_vs_contiguous": None if ratio is None else float(ratio),
            "snapshots": len(mem["time"]),
            "at_peak": None if peak is None else {
                "sequences": peak.num_sequences,
                "logical_pages": peak.logical_pages,
                "physical_pages": peak.physical_pages,
                "wasted_slots": peak.wasted_slots,
                "contiguous_tokens": peak.contiguous_tokens,
            },
        }


def _slots(steps, num_slots: int, stats) -> dict | None:
    """Recurrent-slot usage (hybrid runs only; None otherwise)."""
    if not num_slots:
        return None
    used = steps["slots_used"]
    return {
        "num_slots": num_slots,
        "used_peak": int(_max(used)),
        "used_mean": _mean(used),
        "trie_slots_final": stats.num_trie_slots,
    }


def _latency(req) -> dict:
    return {
        "ttft_s": _dist(req["ttft"]),
        "tpot_s": _dist(req["tpot"]),
        "e2e_s": _dist(req["e2e"]),
        "max_token_gap_s": _dist(req["max_gap"]),
    }


def _useful(req) -> float:
    """Tokens a run without preemption would compute: uncached prompt + outputs."""
    return float((req["prompt_tokens"] - req["cached_tokens"]).sum() + req["output_tokens"].sum())


def _prefix(stats, req) -> dict:
    prompt = float(req["prompt_tokens"].sum())
    first = float(req["cached_tokens"].sum())
    return {
        "hit_rate": stats.hit_rate,
        "hit_tokens": stats.num_hit_tokens,
        "query_tokens": stats.num_query_tokens,
        "queries": stats.num_queries,
        "hits": stats.num_hits,
        "first_admission_hit_rate": first / prompt if prompt else 0.0,
    }


def _bookkeeping(seconds: np.ndarray, num_done: int, wall: float) -> dict:
    total = float(seconds.sum())
    us = seconds * 1e6
    return {
        "seconds_total": total,
        "per_step_us": _dist(us),
        "per_request_us": total * 1e6 / num_done if num_done else None,
        "wall_seconds": wall,
        "share_of_wall": total / wall if wall > 0 else None,
    }


def _dist(values: np.ndarray) -> dict:
    values = values[~np.isnan(values)] if len(values) else values
    if not len(values):
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    pct = np.percentile(values, PERCENTILES)
    out = {"count": int(len(values)), "mean": float(values.mean())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)})
    out["max"] = float(values.max())
    return out


def _rate(amount: float, seconds: float) -> float:
    return float(amount / seconds) if seconds > 0 else 0.0


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else 0.0


def _max(values: np.ndarray) -> float:
    return float(values.max()) if len(values) else 0.0


def _last(values: np.ndarray) -> float:
    return float(values[-1]) if len(values) else 0.0
