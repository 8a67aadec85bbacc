"""`main`: parse, run the subcommand, and turn every failure into one line
and an exit status (2: a bad command line or option, 1: a failed check,
130: interrupted)."""

from __future__ import annotations

import sys
import warnings

from blockmgr.errors import IntegrityError
from scheduler.cli.arguments import UsageError
from scheduler.cli.options import build_parser
from scheduler.cli.serving import cmd_bench, cmd_serve
from scheduler.cli.simulate import cmd_calibrate, cmd_compare, cmd_replay, cmd_simulate
from scheduler.simulator.runner import SimulationError

COMMANDS = {"simulate": cmd_simulate, "replay": cmd_replay, "calibrate": cmd_calibrate,
            "compare": cmd_compare, "serve": cmd_serve, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    """Run the `blockmgr` command on `argv` (default: the process's
    arguments); returns its exit status."""
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning  # a warning is one line, like an error
        return _main(argv)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"blockmgr: warning: {_one_line(message)}", file=sys.stderr)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "blockmgr"
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        prog = f"blockmgr {args.command}"
        return COMMANDS[args.command](args)
    except UsageError as exc:
        if argv and argv[0] in COMMANDS:
            prog = f"blockmgr {argv[0]}"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (SimulationError, IntegrityError) as exc:  # a failed check: a bug, not a usage error
        print(f"{prog}: check failed: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError:  # sizes the checks let through but this machine cannot hold
        print(f"{prog}: error: out of memory; try smaller pools, contexts or a shorter trace",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())

