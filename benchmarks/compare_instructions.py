"""Side by side: CPU instructions per unit of `blockmgr_table.py` cases from
two checkouts, counted by valgrind's callgrind (the same count whatever else
the machine is doing: the figure to trust on a loaded machine; the time
ratios of `compare_checkouts.py` say the same when it is quiet).

Run: python benchmarks/compare_instructions.py BASE_DIR [--only d1,b1] [--calls 200]

Each case is built by the checkout's own table script (its `make`), then
callgrind counts only the `--calls` calls of its `run` (instrumentation
switched on and off around them with `callgrind_control`), divided by the
units those calls do. PYTHONHASHSEED is fixed and the garbage collector off
while counting, so a count repeats to within a few instructions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

#: The child: build one case of a checkout's table, count `calls` runs.
CHILD = """
import gc, importlib.util, os, subprocess, sys
root, key, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("table", \
os.path.join(root, "benchmarks", "blockmgr_table.py"))
table = importlib.util.module_from_spec(spec)
sys.modules["table"] = table  # its dataclasses look their module up
spec.loader.exec_module(table)
case = next(c for c in table.CASES if c.key == key)
bench = case.make(calls)
gc.collect(); gc.disable()
pid = str(os.getpid())
subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True)
for _ in range(calls):
    bench.run()
subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True)
print("UNITS", bench.units * calls)
"""


def count(checkout: Path, key: str, calls: int) -> float:
    """Instructions per unit of case `key` of `checkout`'s table."""
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "child.py"
        child.write_text(CHILD)
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={tmp}/out.%p", sys.executable, str(child), str(checkout),
             key, str(calls)],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    units = float(next(line.split()[1] for line in out.stdout.splitlines()
                        if line.startswith("UNITS")))
    collected = next(line for line in out.stderr.splitlines() if "Collected" in line)
    return int(collected.split()[-1]) / units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the other checkout (e.g. the code before)")
    parser.add_argument("--only", default="b1,d1", help="comma-separated case keys")
    parser.add_argument("--calls", type=int, default=0,
                        help="calls counted per case (default: the case's own iterations)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from benchmarks.blockmgr_table import CASES  # noqa: E402 - this checkout's cases

    iterations = {case.key: case.iterations for case in CASES}
    keys = args.only.split(",")
    if unknown := [key for key in keys if key not in iterations]:
        parser.error(f"no such case: {', '.join(unknown)} (see blockmgr_table.py)")
    print(f"instructions per unit (callgrind), base {args.base.resolve()}, this {HERE}")
    print("| case | base | this | ratio |")
    print("|---|---|---|---|")
    for key in keys:
        calls = args.calls or iterations[key]
        base, this = count(args.base.resolve(), key, calls), count(HERE, key, calls)
        print(f"| {key} | {base:,.0f} | {this:,.0f} | {this / base:.3f} |")


if __name__ == "__main__":
    main()
