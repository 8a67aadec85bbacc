"""The `blockmgr` command line.

    blockmgr simulate [options]          one simulation, report folder
    blockmgr simulate --sweep [GRID]     a grid of simulations in parallel
    blockmgr simulate --profile FILE     with a calibrated cost model
    blockmgr replay --preset NAME ...    the same workload through the real engine
    blockmgr calibrate --preset NAME     cost profile of the real engine here
    blockmgr compare A B                 two reports side by side
    blockmgr serve --model DIR           an OpenAI-compatible server (design/serving.md)
    blockmgr bench --url URL [options]   the workload against a server, the same report

Every option is validated; a bad one prints one line
(``blockmgr simulate: error: ...``) and exits with status 2. A failed
`--check` (integrity or leak) prints one line and exits with status 1. See
design/simulator.md for the workloads and metrics.

The package, by what each module holds: `arguments` (the options' types),
`options` (`build_parser`: every subcommand's options), `config`
(`build_config`: the simulation a command line describes), `simulate` and
`serving` (the commands), `main` (`main`: failures into one line and an
exit status). `python -m scheduler.cli` runs `main`.
"""

from scheduler.cli.arguments import UsageError, parse_mix
from scheduler.cli.config import build_config, check_trace
from scheduler.cli.main import COMMANDS, main
from scheduler.cli.options import SCHEDULER_OPTIONS, build_parser, kv_format_fields
from scheduler.cli.serving import serve_settings, serve_speculation, startup_line
from scheduler.cli.simulate import fleet_of

__all__ = [
    "COMMANDS",
    "SCHEDULER_OPTIONS",
    "UsageError",
    "build_config",
    "build_parser",
    "check_trace",
    "fleet_of",
    "kv_format_fields",
    "main",
    "parse_mix",
    "serve_settings",
    "serve_speculation",
    "startup_line",
]
