"""Diff the simulate reports of two source trees over a fixed set of runs.

    python benchmarks/sim_report_identity.py OLD_ROOT [NEW_ROOT] [--quick] [--added-config] \\
        [CASE ...]

Runs each case with `python -m scheduler.cli simulate` from both roots
(fixed seeds) and compares report.json, leaving out the fields that measure
wall time (bookkeeping, environment). Exit status 1 when any report differs;
the first differing paths are printed. Used to check that a speed change to
the scheduler, block manager or runner keeps every simulated number.
`--added-config`: config fields only the new tree has (a new option at its
default, e.g. the cache tiers) are not differences.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"

CASES: dict[str, list[str]] = {
    "chat": ["--workload", "chat", "-n", "3000", "--rate", "5", "--check"],
    "all": ["--workload", "all", "-n", "1500", "--check", "--seed", "3"],
    "gemma3": ["--workload", "chat,agent", "-n", "1000", "--layout", "gemma3", "--check"],
    "hybrid": ["--workload", "chat=0.6,agent=0.4", "-n", "1000", "--hybrid", "--check"],
    "qwen3_next": ["--workload", "multiturn", "-n", "800", "--layout", "qwen3_next", "--check"],
    "recompute": ["--workload", "chat,parallel", "-n", "800", "--num-blocks", "600", "--rate", "20",
                  # the older spellings: the code before a change may not know vLLM's names
                  "--check", "--long-prefill-threshold", "256", "--max-partial-prefills", "2"],
    "swap": ["--workload", "agent", "-n", "600", "--num-blocks", "700", "--num-host-blocks", "2000",
             "--preemption", "swap", "--policy", "priority", "--rate", "20", "--check"],
    "sliding": ["--workload", "multiturn", "-n", "600", "--layout", "sliding",
                "--sliding-window", "256", "--num-blocks", "800", "--check"],
    "closed": ["--workload", "tenants", "-n", "800", "--arrival", "closed", "--concurrency", "48",
               "--block-size", "32", "--watermark", "0.05", "--check"],
    "mooncake": ["--trace", str(TRACE), "--num-blocks", "65536", "--time-scale", "4", "--check"],
}
QUICK = ("chat", "gemma3", "hybrid", "swap")
WALL_TIME_KEYS = ("bookkeeping", "environment", "wall_seconds")


def _strip(value):
    """The report without its wall-time fields."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in WALL_TIME_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _differences(old, new, path="", added_config: bool = False) -> list[str]:
    """Paths where the reports differ; with `added_config`, a config field
    only the new report has (a new option at its default) is not one."""
    if isinstance(old, dict) and isinstance(new, dict):
        only = set(old) ^ set(new)
        if added_config and path.startswith(".config"):
            only -= set(new) - set(old)
        out = [f"{path}.{k}: only in one" for k in only]
        for key in old.keys() & new.keys():
            out += _differences(old[key], new[key], f"{path}.{key}", added_config)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            out += _differences(a, b, f"{path}[{i}]", added_config)
        return out
    return [] if old == new else [f"{path}: {str(old)[:60]} != {str(new)[:60]}"]


def run_report(root: Path, args: list[str], out: Path) -> dict:
    """report.json of one simulate run from the source tree at root."""
    subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "simulate", *args,
         "--no-plots", "--no-progress", "--json", "--out", str(out)],
        cwd=root, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "report.json").read_text())


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    added_config = "--added-config" in argv
    chosen = tuple(a for a in argv if a in CASES)
    roots = [Path(a).resolve() for a in argv if not a.startswith("--") and a not in CASES]
    old_root = roots[0]
    new_root = roots[1] if len(roots) > 1 else Path(__file__).resolve().parents[1]
    names = chosen or (QUICK if quick else tuple(CASES))
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name == "mooncake" and not TRACE.exists():
                print(f"{name}: skipped (no trace at {TRACE})")
                continue
            old = _strip(run_report(old_root, CASES[name], Path(tmp) / f"old-{name}"))
            new = _strip(run_report(new_root, CASES[name], Path(tmp) / f"new-{name}"))
            diffs = _differences(old, new, added_config=added_config)
            print(f"{name}: {'identical' if not diffs else f'{len(diffs)} differences'}")
            for line in diffs[:10]:
                print("   ", line)
            failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
