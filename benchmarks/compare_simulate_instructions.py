"""Side by side: CPU instructions of one `blockmgr simulate` run from two
checkouts, counted by valgrind's callgrind: the same count whatever else the
machine is doing (`compare_simulate_cpu.py` measures seconds, which a loaded
machine moves by 10-40 %).

Run: python benchmarks/compare_simulate_instructions.py BASE_DIR -- SIMULATE_ARGS...
e.g. python benchmarks/compare_simulate_instructions.py /tmp/base -- \\
         --workload chat -n 1000 --rate 5

Only the run is counted: instrumentation is switched on (`callgrind_control`)
after the imports and off after `simulate` returns. PYTHONHASHSEED is fixed.
Under callgrind a run takes about 50 times as long: 1,000 chat requests take
1-3 minutes per checkout. The count per request of a short run is close to
a long one's (the simulator's work per request does not grow with the run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

#: The child: import this checkout's CLI, count one `simulate` run.
CHILD = """
import gc, os, subprocess, sys
root, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
os.chdir(root)
from scheduler.cli import main
import scheduler.simulator.runner  # imported before counting
gc.collect()
pid = str(os.getpid())
subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True, check=True)
code = main(["simulate", *sys.argv[3:], "--no-plots", "--no-progress", "--json", "--out", out])
subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True, check=True)
sys.exit(code or 0)
"""


def count(checkout: Path, args: list[str]) -> int:
    """Instructions of one simulate run from `checkout`."""
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "child.py"
        child.write_text(CHILD)
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={tmp}/cg.%p", sys.executable, str(child), str(checkout),
             f"{tmp}/report", *args],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    collected = next(line for line in out.stderr.splitlines() if "Collected" in line)
    return int(collected.split()[-1])


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    if split != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    base, args = Path(argv[0]).resolve(), argv[split + 1:]
    print(f"instructions of `simulate {' '.join(args)}` (callgrind), base {base}, this {HERE}")
    counts = count(base, args), count(HERE, args)
    print("| base | this | ratio |")
    print("|---|---|---|")
    print(f"| {counts[0]:,} | {counts[1]:,} | {counts[1] / counts[0]:.3f} |")


if __name__ == "__main__":
    main()
