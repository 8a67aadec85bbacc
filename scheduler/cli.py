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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockmgr.errors import IntegrityError
from blockmgr.kv_format import BITS, DEFAULT_GROUP_SIZE, KVFormat, parse_bytes
from scheduler.engine.config import settings
from scheduler.serving.serve import KV_MEMORY_FRACTION, SERVE_DEFAULTS
from scheduler.serving.status import DEFAULT_STATUS_INTERVAL
from scheduler.simulator.kv_memory import engine_num_slots
from scheduler.simulator.layout import LAYOUTS, ModelLayout, layout_named
from scheduler.simulator.lengths import LengthSpecError, parse_length
from scheduler.simulator.runner import SimulationError
from scheduler.simulator.workloads import WORKLOAD_KINDS

DEFAULT_OUT = "blockmgr-report"
DEFAULT_CHECK_EVERY = 256


class UsageError(Exception):
    """A bad command line; the message is printed on one line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        raise UsageError(message)


# ----------------------------------------------------------------- parsing


def parse_mix(spec: str) -> dict[str, float]:
    """``chat`` | ``chat,agent`` | ``chat=0.7,agent=0.3`` | ``all`` -> weights."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty workload")
    if spec.strip() == "all":
        return {kind: 1.0 for kind in WORKLOAD_KINDS}
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, eq, weight = part.partition("=")
        kind = kind.strip().lower()
        if kind not in WORKLOAD_KINDS:
            raise ValueError(f"unknown workload {kind!r} (one of {', '.join(WORKLOAD_KINDS)}, or all)")
        try:
            value = float(weight) if eq else 1.0
        except ValueError:
            raise ValueError(f"workload weight must be a number, got {weight!r}") from None
        if not value >= 0:
            raise ValueError(f"workload weight must be >= 0, got {weight!r}")
        mix[kind] = mix.get(kind, 0.0) + value
    return mix


def _int_at_least(minimum: int):
    """An argparse type: an int >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _length(text: str):
    try:
        return parse_length(text)
    except LengthSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mix(text: str) -> dict[str, float]:
    try:
        mix = parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return mix


def _costs(text: str) -> dict[str, float]:
    from scheduler.simulator.cost_model import CostModel

    known = CostModel.__dataclass_fields__
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            raise argparse.ArgumentTypeError(
                f"expected key=seconds with key in {', '.join(known)}, got {part!r}"
            )
        out[key] = _nonneg_float(value)
    return out


def _shape(text: str) -> dict:
    """``key=value,...`` with JSON values (numbers, true/false); others are strings."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="blockmgr", description="Paged KV cache manager tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sim = sub.add_parser(
        "simulate",
        help="stress-simulate the scheduler and block manager on a workload",
        description="Run the real scheduler and block manager on a synthetic or traced "
        "workload, with a cost model instead of a model, and write a report.",
    )
    _add_workload_options(sim)
    _add_pool_options(sim)
    _add_kv_memory_options(sim)
    r = _add_run_options(sim)
    r.add_argument("--cost", type=_costs, metavar="K=S,...",
                   help="cost model seconds, e.g. step_overhead=0.01,decode_per_token=0.0005")
    r.add_argument("--profile", metavar="FILE",
                   help="cost model from a `blockmgr calibrate` profile (--cost still overrides); "
                        "its model's layout too, unless --layout, --sliding-window or --config gives one")
    r.add_argument("--sweep", nargs="?", const="default", metavar="GRID",
                   help="run a grid, e.g. 'num_blocks=1024,4096;block_size=16,32' (default grid if no value)")
    r.add_argument("--jobs", type=_positive_int, help="sweep worker processes (default 2)")
    r.add_argument("--ray", metavar="ADDRESS",
                   help="run the sweep on a Ray cluster (an address, or 'local' to start one here; "
                        "needs the ray extra)")
    r.add_argument("--replicas", type=_positive_int, metavar="N",
                   help="simulate a fleet of N such servers behind --router (sweep: replicas=...)")
    r.add_argument("--router", metavar="POLICY", help="the fleet's router: round_robin (default), "
                   "least_load, cache_aware, precise (sweep: router=...)")
    r.add_argument("--cores", type=_positive_float, metavar="C",
                   help="the fleet's replicas share one machine of C cores, a step in flight "
                        "beside others ending later than priced (default: a machine each)")
    r.add_argument("--background", type=_nonneg_float, metavar="B",
                   help="with --cores: B runnable threads of other work share those cores "
                        "(default 0)")
    r.add_argument("--step-jitter", type=_nonneg_float, metavar="SIGMA",
                   help="the fleet's steps each take a random factor of their priced time "
                        "(log-normal, mean 1, its log's standard deviation SIGMA; a "
                        "calibration's repeated steps vary by about 0.1); default 0: none")
    r.add_argument("--fleet-seed", type=int, metavar="N",
                   help="the seed of the fleet's step jitter (default 0)")

    rep = sub.add_parser(
        "replay",
        help="run a workload or trace through the real engine and write the same report",
        description="Run the workload (the same options as simulate) through the real Engine "
        "on a model, timed on this machine, and write a report comparable with a simulation's.",
    )
    _add_model_options(rep)
    _add_workload_options(rep)
    _add_pool_options(rep)
    _add_run_options(rep)
    rep.set_defaults(cost=None, profile=None, sweep=None, jobs=None, ray=None, **KV_DEFAULTS)

    cal = sub.add_parser(
        "calibrate",
        help="profile the real engine on this machine and fit the simulator's cost model",
        description="Time real Engine steps over a grid of batch shapes and write a cost "
        "profile (JSON) for `blockmgr simulate --profile`.",
    )
    _add_model_options(cal)
    cal.add_argument("--out", metavar="FILE", default="cost-profile.json",
                     help="profile file (default ./cost-profile.json)")
    cal.add_argument("--quick", action="store_true", help="a small grid (about a minute on a small model)")
    cal.add_argument("--repeats", type=_positive_int, help="measure the grid this many times (default 2)")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_setting(cal, "disk_cache", None,
                 help="time the disk tier's reads and writes on this directory's disk "
                      "(the one `serve --disk-cache` will use; default the system's temp "
                      "directory); a temporary folder inside it is removed after")

    cmp_ = sub.add_parser(
        "compare",
        help="compare two reports (e.g. simulated vs real) metric by metric",
        description="Print a table of the headline metrics of two report.json files and the "
        "relative difference of the second from the first.",
    )
    cmp_.add_argument("reports", nargs=2, metavar="REPORT", help="report.json (or its folder)")
    cmp_.add_argument("--json", action="store_true", help="print the table as JSON")
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    return parser


def _add_model_options(parser) -> None:
    g = parser.add_argument_group("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a local mlx-lm model directory")
    src.add_argument("--preset", metavar="NAME",
                     help="an architecture with random weights: qwen3-0.6b, llama-3.2-1b, "
                          "qwen3-0.6b-sliding, lfm2-350m")
    g.add_argument("--layers", type=_positive_int, metavar="N", help="keep the first N layers")
    g.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by the wall clock (default) or by this process's CPU time, "
                        "which leaves out other processes' use of a shared machine")
    g.add_argument("--shape", type=_shape, metavar="K=V,...",
                   help="preset config fields to replace, e.g. hidden_size=256,vocab_size=32000")


def _add_workload_options(parser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", type=_mix, metavar="MIX",
                   help=f"kinds, optionally weighted: chat | chat,agent | chat=0.7,multiturn=0.3 | all "
                        f"(kinds: {', '.join(WORKLOAD_KINDS)}; default all, equal weights)")
    w.add_argument("-n", "--num-requests", type=_positive_int, metavar="N", help="requests in total (default 2000)")
    w.add_argument("--seed", type=_nonneg_int, help="workload seed (default 0)")
    w.add_argument("--arrival", choices=("poisson", "closed"), help="open-loop Poisson or closed loop")
    w.add_argument("--rate", type=_positive_float, help="Poisson: new sessions per simulated second (default 1)")
    w.add_argument("--concurrency", type=_positive_int, help="closed loop: clients (default 64)")
    w.add_argument("--system-len", type=_length, metavar="DIST", help="system prompt length, e.g. fixed:512")
    w.add_argument("--user-len", type=_length, metavar="DIST", help="user message length, e.g. lognormal:mean=120")
    w.add_argument("--output-len", type=_length, metavar="DIST", help="output length (chat-like kinds)")
    w.add_argument("--turns", type=_length, metavar="DIST", help="multiturn: turns per conversation")
    w.add_argument("--agent-steps", type=_length, metavar="DIST", help="agent: steps per loop")
    w.add_argument("--tool-output-len", type=_length, metavar="DIST", help="agent: tool output length")
    w.add_argument("--think-time", type=_nonneg_float, metavar="S", help="multiturn: mean think time")
    w.add_argument("--tool-time", type=_nonneg_float, metavar="S", help="agent: mean tool latency")
    w.add_argument("--max-context", type=_positive_int, metavar="TOKENS", help="session context cap (default 8192)")
    w.add_argument("--num-system-prompts", type=_positive_int, metavar="K")
    w.add_argument("--num-tenants", type=_positive_int, metavar="K", help="tenants: namespaces")
    w.add_argument("--samples", type=_positive_int, metavar="N", help="parallel: samples per request (default 4)")
    w.add_argument("--trace", metavar="FILE", help="replay a JSONL trace instead of generating")
    w.add_argument("--write-trace", metavar="FILE", help="write the generated workload as a trace")
    w.add_argument("--trace-block-tokens", type=_positive_int, metavar="TOKENS",
                   help="tokens per prefix-id (hash_ids) block of the trace (default: its header, "
                        "else 512 as in Mooncake traces)")
    w.add_argument("--time-scale", type=_positive_float, metavar="F",
                   help="multiply the trace's arrival and think times by F (0.5: twice the load)")



def _add_pool_options(parser) -> None:
    """The block manager's and the scheduler's options (simulate, replay),
    stating `SimulationConfig`'s defaults."""
    m = parser.add_argument_group("block manager")
    add = _setting_adder(m, _simulation_default)
    add("num_blocks")
    add("block_size")
    m.add_argument("--hybrid", action="store_true", help="hybrid model: recurrent slots in play")
    add("num_slots", default_text="with --hybrid: 2 x max seqs; with --kv-memory: 2 x max "
                                  "seqs + 2, as serve gives the engine")
    add("enable_prefix_cache", dest="no_prefix_cache")
    add("watermark")
    m.add_argument("--layout", choices=sorted(LAYOUTS),
                   help="model layer kinds, one store group per attention window (default full)")
    m.add_argument("--sliding-window", type=_positive_int, metavar="TOKENS",
                   help="window of the layout's sliding layers (alone: every layer sliding)")
    add("num_host_blocks", default_text="with swap: num blocks")
    add("num_host_slots", default_text="with --hybrid and swap: num slots")
    m.add_argument("--num-host-cache-blocks", type=_nonneg_int,
                   help="pages of the prefix cache's host tier (default 0: none; design/tiers.md)")
    m.add_argument("--num-host-cache-slots", type=_nonneg_int,
                   help="recurrent snapshots of the host tier (default with --hybrid: num slots)")
    m.add_argument("--num-disk-blocks", type=_nonneg_int,
                   help="pages of the prefix cache's disk tier (default 0: none)")
    m.add_argument("--num-disk-slots", type=_nonneg_int,
                   help="recurrent snapshots of the disk tier (default with --hybrid: num slots)")
    _add_scheduler_options(parser, _simulation_default)


#: The scheduler's settings every subcommand that runs a scheduler takes.
SCHEDULER_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "policy", "preemption",
                     "long_prefill_token_threshold", "max_num_partial_prefills")


#: The engine settings `blockmgr serve` takes (besides the page format's
#: options), in the order of its help; `SERVED_SCHEDULER_OPTIONS` of them
#: in the scheduler's group.
SERVED_SETTINGS = ("num_blocks", "disk_cache", "disk_cache_size", "host_cache_size",
                   "block_size", "max_num_seqs", "max_num_batched_tokens", "policy",
                   "long_prefill_token_threshold", "max_num_partial_prefills", "prefill_batch",
                   "max_model_len")
SERVED_SCHEDULER_OPTIONS = tuple(n for n in SCHEDULER_OPTIONS if n in SERVED_SETTINGS)
#: serve's defaults that are rules, not values (the option is then absent: None).
SERVE_DEFAULT_TEXT = {
    "num_blocks": "sized by --kv-memory, which it overrides",
    "max_model_len": "the model's context from its config.json, at most what the pool "
                     "holds; longer requests get 400",
}


def _serve_default(name: str) -> object:
    """The default `blockmgr serve` gives the setting `name`: the engine's,
    unless `serve.SERVE_DEFAULTS` changes it."""
    return SERVE_DEFAULTS.get(name, SETTINGS[name].default)


def _add_scheduler_options(parser, default_of, names=SCHEDULER_OPTIONS, **defaults) -> None:
    """The scheduler's settings `names`, generated from their declarations
    (`scheduler.engine.config`), stating `default_of(name)` unless
    `defaults` gives the command's own."""
    s = parser.add_argument_group("scheduler")
    add = _setting_adder(s, default_of)
    for name in names:
        add(name, default=defaults.get(name))


def _simulation_default(name: str) -> object:
    """The default `SimulationConfig` has for the setting `name` (its block
    manager's or its scheduler's)."""
    from scheduler.simulator.config import SimulationConfig

    config = SimulationConfig()
    part = config.scheduler if SETTINGS[name].part == "scheduler" else config.block_manager
    return getattr(part, name)


def _engine_default(name: str) -> object:
    """The default the engine's config declares for the setting `name`."""
    return SETTINGS[name].default


#: Every engine setting, declared once (`scheduler.engine.config`): the
#: options below are generated from these declarations.
SETTINGS = settings()


def _setting_adder(group, default_of):
    """`add(name, ...)`: `_add_setting` on `group`, with the defaults the
    command states read by `default_of(name)`."""

    def add(name: str, **kwargs: Any) -> None:
        _add_setting(group, name, default_of(name), **kwargs)

    return add


def _add_setting(group, name: str, shown: object, *, default: object = None,
                 default_text: str | None = None, help: str | None = None,
                 dest: str | None = None) -> None:
    """The option of the declared setting `name` (its one name, its help,
    parsed by its declared bounds and choices), with its old spellings
    hidden. `default`: the value when the option is absent (None: the
    command applies `shown`, the default its help states); `default_text`:
    a default that is a rule rather than a value; `help`: a command's other
    use of the same setting (calibrate's --disk-cache)."""
    setting = SETTINGS[name]
    if default is not None:
        shown = default
    text = help if help is not None else setting.help_text(shown, default_text)
    dest = dest or name
    if setting.option.startswith("--no-"):  # a setting on by default, turned off
        group.add_argument(setting.option, action="store_true", dest=dest,
                           help=f"do not {setting.help}" if help is None else help)
        return
    kind = _setting_type(setting)
    group.add_argument(setting.option, type=kind, choices=setting.choices, dest=dest,
                       metavar=setting.metavar, default=default, help=text)
    for old in setting.old:
        group.add_argument(old, action=_DeprecatedAlias, type=kind, dest=dest,
                           metavar=setting.option, help=argparse.SUPPRESS)


def _setting_type(setting) -> Callable[[str], Any] | None:
    """The argparse type of a setting: by its choices' type, its declared
    minimum (int or float), else text (sizes, directories, names)."""
    if setting.choices is not None:
        return type(setting.choices[0]) if not isinstance(setting.choices[0], str) else None
    if isinstance(setting.minimum, float):
        return _nonneg_float if setting.minimum == 0 else _positive_float
    if isinstance(setting.minimum, int):
        return _int_at_least(setting.minimum)
    return None


class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores under the new one's name and
    prints one deprecation line."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.metavar  # the new spelling (kept out of help: the alias is hidden)
        print(f"blockmgr: {option_string} is deprecated; use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


#: The KV options of simulate that replay and bench do not take (a replay
#: runs the format of its --config).
KV_DEFAULTS = {"kv_memory": None, "kv_shape": None, "kv_bits": None, "kv_key_bits": None,
               "kv_value_bits": None, "kv_group_size": None}


def _add_kv_format_options(parser, title: str):
    """--kv-bits, --kv-key-bits, --kv-value-bits, --kv-group-size (serve,
    simulate), in a group of their own, which is returned."""
    k = parser.add_argument_group(title)
    add = _setting_adder(k, _engine_default)
    add("kv_bits")
    k.add_argument("--kv-key-bits", type=int, choices=BITS, metavar="BITS",
                   help="keys' bits, over --kv-bits (e.g. --kv-bits 4 --kv-key-bits 8)")
    k.add_argument("--kv-value-bits", type=int, choices=BITS, metavar="BITS",
                   help="values' bits, over --kv-bits")
    add("kv_group_size")
    return k


def _add_kv_memory_options(parser) -> None:
    """simulate: a pool sized by KV memory, as the engine sizes its own."""
    k = _add_kv_format_options(parser, "KV memory (design/simulator.md, \"KV memory\")")
    k.add_argument("--kv-memory", metavar="SIZE",
                   help="size the pool as blockmgr serve does: the pages (in the --kv-bits "
                        "format) that SIZE (e.g. 4GiB) holds after the recurrent slots, for "
                        "a model of --kv-shape (instead of --num-blocks)")
    k.add_argument("--kv-shape", type=_shape, metavar="K=V,...",
                   help="the model's KV: layers (attention layers), kv_heads, head_dim, "
                        "v_head_dim (default head_dim), dtype (float16, bfloat16, float32; "
                        "default float16), slot_bytes (hybrid: one recurrent slot), e.g. "
                        "layers=28,kv_heads=8,head_dim=128,dtype=bfloat16")


def kv_format_fields(args) -> dict | None:
    """`KVFormat` fields of the --kv-*bits and --kv-group-size options (None:
    none given, the model's dtype). --kv-key-bits / --kv-value-bits replace
    --kv-bits on their side. Raises ValueError for a group size without bits
    or a --kv-bits both sides replace."""
    key, value = args.kv_key_bits, args.kv_value_bits
    if key is not None and value is not None and args.kv_bits is not None:
        raise ValueError("--kv-bits has no effect beside both --kv-key-bits and "
                         "--kv-value-bits; drop one of them")
    key = args.kv_bits if key is None else key
    value = args.kv_bits if value is None else value
    if key is None and value is None:
        if args.kv_group_size is not None:
            raise ValueError("--kv-group-size needs --kv-bits (or --kv-key-bits / "
                             "--kv-value-bits)")
        return None
    size = DEFAULT_GROUP_SIZE if args.kv_group_size is None else args.kv_group_size
    return {"key_bits": key, "value_bits": value, "group_size": size}


def _add_run_options(parser):
    r = parser.add_argument_group("run and report")
    r.add_argument("--check", nargs="?", const=DEFAULT_CHECK_EVERY, type=_positive_int, metavar="K",
                   help=f"check_integrity() every K steps (default {DEFAULT_CHECK_EVERY}) and a leak check at the end")
    r.add_argument("--sample-every", type=_positive_int, metavar="STEPS", help="memory snapshot interval (default 32)")
    r.add_argument("--config", metavar="FILE", help="start from a config (or a report.json) and apply options")
    r.add_argument("--out", metavar="DIR", help=f"report folder (default ./{DEFAULT_OUT})")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--json", action="store_true", help="print the summary as JSON (nothing else on stdout)")
    return r


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve an mlx-lm model directory over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics) over the paged engine. See design/serving.md.",
    )
    serve.add_argument("--model", required=True, metavar="DIR", help="mlx-lm model directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_int_at_least(0), default=8000, help="port (default 8000)")
    serve.add_argument("--kv-memory", metavar="SIZE",
                       help="KV memory, e.g. 4GiB or 512MB: a hybrid model's recurrent slots "
                            "first, pages with the rest (default: --kv-memory-fraction of the "
                            "memory available at start, after the weights); allocated at start")
    serve.add_argument("--kv-memory-fraction", type=float, default=KV_MEMORY_FRACTION,
                       metavar="F", help=f"share of the available memory the KV pool takes "
                                         f"without --kv-memory (default {KV_MEMORY_FRACTION})")
    serve.add_argument("--status-interval", type=_nonneg_float, default=DEFAULT_STATUS_INTERVAL,
                       metavar="SECONDS",
                       help=f"seconds between status lines (running, waiting, KV use, prefix "
                            f"hit rate, tokens/s) while busy; 0: none (default "
                            f"{DEFAULT_STATUS_INTERVAL:g})")
    add = _setting_adder(serve, _engine_default)
    for name in SERVED_SETTINGS:
        if name in SCHEDULER_OPTIONS:
            continue  # in the scheduler's group below
        text = SERVE_DEFAULT_TEXT.get(name)
        add(name, default=None if text else _serve_default(name), default_text=text)
    _add_kv_format_options(serve, "KV page format (design/serving.md)")
    _add_scheduler_options(serve, _serve_default, names=SERVED_SCHEDULER_OPTIONS,
                           **{name: _serve_default(name) for name in SERVED_SCHEDULER_OPTIONS})
    serve.add_argument("--max-waiting", type=_positive_int, default=256,
                       help="waiting requests before new ones get 429 (default 256)")
    serve.add_argument("--max-body-size", metavar="SIZE",
                       help="largest request body, e.g. 16MiB; larger ones get 413 before they "
                            "are read (default: 32 bytes per token of --max-model-len, at "
                            "least 1MiB)")
    serve.add_argument("--draft-model", metavar="DIR",
                       help="a small mlx-lm model directory with the same vocabulary: "
                            "speculative decoding (its KV pages come on top of --kv-memory)")
    add("num_speculative_tokens", default=_serve_default("num_speculative_tokens"))
    serve.add_argument("--enable-prefix-cache-reset", action="store_true",
                       help="serve POST /reset_prefix_cache (drops every cached prefix no "
                            "request uses; off by default, as in vLLM)")
    serve.add_argument("--served-model-name", help="model id in the API (default: DIR's name)")
    serve.add_argument("--shutdown-timeout", type=_nonneg_float, default=10.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long in-flight requests may finish before "
                            "they are aborted (default 10)")
    serve.add_argument("--kv-events", metavar="ENDPOINT", nargs="?", const="",
                       help="publish the prefix cache's KV events for cache-aware routers "
                            "(vLLM's format) over ZMQ; alone: bound on tcp://127.0.0.1:5557 "
                            "(this machine only); an ENDPOINT follows vLLM's rule (tcp://*:5557 "
                            "binds every interface, tcp://HOST:PORT connects) unless "
                            "--kv-events-bind (needs the events extra; design/kv_events.md)")
    serve.add_argument("--kv-events-bind", action="store_true",
                       help="bind --kv-events' ENDPOINT whatever its host: loopback "
                            "(tcp://127.0.0.1:5557) or one interface (tcp://eth0:5557)")
    serve.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                       help="ZMQ topic of the events (llm-d reads kv@<pod>@<model>; default '')")
    serve.add_argument("--kv-events-replay", metavar="ENDPOINT",
                       help="ZMQ ROUTER endpoint answering replay requests for missed batches")
    serve.add_argument("--grpc-port", type=_int_at_least(0), metavar="PORT",
                       help="also serve the Shepherd Model Gateway's gRPC worker service on "
                            "--host:PORT (generation on token ids, loads, tokenizer, KV events "
                            "for its event-driven cache_aware routing; the fleet extra; "
                            "design/fleet.md)")


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="replay a workload or trace against an OpenAI-compatible server",
        description="Send the workload (the same options and trace files as simulate) to a "
                    "server (blockmgr serve, mlx_lm.server, vLLM) at its arrival times, streaming, "
                    "and write the same report (throughput, TTFT/TPOT, server-reported cached "
                    "tokens). See design/serving.md.",
    )
    b = bench.add_argument_group("server")
    b.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", help="model id to send (default: the first of GET /v1/models)")
    b.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="endpoint (default chat)")
    b.add_argument("--prompt-format", choices=("text", "tokens"), default="text",
                   help="prompts as text (one word per token id; default) or token ids "
                        "(completions only; not mlx_lm.server)")
    b.add_argument("--vocab-size", type=_int_at_least(2), metavar="V",
                   help="token ids drawn from [0, V) (default 32000; tokens prompts must fit the "
                        "server's vocabulary)")
    b.add_argument("--timeout", type=_positive_float, default=600.0, metavar="SECONDS",
                   help="one request's time limit (default 600)")
    b.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (outputs may end before max_tokens)")
    b.add_argument("--api-key", help="sent as a bearer token")
    b.add_argument("--fresh-cache", action="store_true",
                   help="send a new cache_salt this run: a server that honours it (blockmgr "
                        "serve, vLLM) cannot answer from an earlier run's prefix cache")
    _add_workload_options(bench)
    r = bench.add_argument_group("run and report")
    r.add_argument("--config", metavar="FILE", help="start from a config (or a report.json) and apply options")
    r.add_argument("--out", metavar="DIR", help=f"report folder (default ./{DEFAULT_OUT})")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--json", action="store_true", help="print the summary as JSON (nothing else on stdout)")
    scratch = _Parser(add_help=False)
    _add_pool_options(scratch)
    bench.set_defaults(**vars(scratch.parse_args([])), check=None, sample_every=None, cost=None,
                       profile=None, **KV_DEFAULTS)


# ---------------------------------------------------------------- config


def build_config(args):
    """The SimulationConfig the options describe. Raises ValueError."""
    from scheduler.simulator.config import SimulationConfig, apply_kv_memory

    data = SimulationConfig().to_dict() if args.config is None else _load_config(args.config)
    defaults = SimulationConfig().to_dict()
    data = {**defaults, **data}
    for section in ("workload", "block_manager", "scheduler", "cost"):
        if not isinstance(data[section], dict):
            raise ValueError(
                f"config section {section!r} must be a JSON object, got {data[section]!r:.60}"
            )
        data[section] = {**defaults[section], **data[section]}  # missing keys: defaults
    wl, bm, sc = dict(data["workload"]), dict(data["block_manager"]), dict(data["scheduler"])
    cost = dict(data["cost"])
    for opt, key in (
        ("workload", "mix"), ("num_requests", "num_requests"), ("seed", "seed"),
        ("arrival", "arrival"), ("rate", "rate"), ("concurrency", "concurrency"),
        ("think_time", "think_time"), ("tool_time", "tool_time"), ("max_context", "max_context"),
        ("num_system_prompts", "num_system_prompts"), ("num_tenants", "num_tenants"),
        ("samples", "n"),
    ):
        if getattr(args, opt) is not None:
            wl[key] = getattr(args, opt)
    for opt, key in (
        ("system_len", "system_len"), ("user_len", "user_len"), ("output_len", "output_len"),
        ("turns", "turns"), ("agent_steps", "agent_steps"), ("tool_output_len", "tool_output_len"),
    ):
        if getattr(args, opt) is not None:
            wl[key] = getattr(args, opt).spec()
    for opt, key in (
        ("num_blocks", "num_blocks"), ("block_size", "block_size"), ("num_slots", "num_slots"),
        ("watermark", "watermark"), ("num_host_blocks", "num_host_blocks"),
        ("num_host_slots", "num_host_slots"), ("num_host_cache_blocks", "num_host_cache_blocks"),
        ("num_host_cache_slots", "num_host_cache_slots"), ("num_disk_blocks", "num_disk_blocks"),
        ("num_disk_slots", "num_disk_slots"),
    ):
        if getattr(args, opt) is not None:
            bm[key] = getattr(args, opt)
    if args.no_prefix_cache:
        bm["enable_prefix_cache"] = False
    for key in SCHEDULER_OPTIONS:
        if getattr(args, key) is not None:
            sc[key] = getattr(args, key)
    if args.layout is not None or args.sliding_window is not None:
        name = args.layout or ("sliding" if args.sliding_window is not None else "full")
        data["layout"] = layout_named(name, args.sliding_window).to_dict()
    elif args.profile is not None and args.config is None:
        from scheduler.simulator.profile import read_layout

        data["layout"] = read_layout(args.profile).to_dict()  # the store the profile timed
    recurrent = ModelLayout.from_dict(data["layout"]).recurrent  # ValueError if malformed
    if (args.hybrid or recurrent) and args.num_slots is None and not bm.get("num_slots"):
        sized = args.kv_memory is not None or data.get("kv_memory") is not None
        # a pool sized by KV memory has the slots serve gives the engine
        bm["num_slots"] = (engine_num_slots(sc["max_num_seqs"]) if sized
                           else 2 * sc["max_num_seqs"])
    if args.hybrid and not bm.get("num_slots"):
        raise ValueError("--hybrid needs --num-slots >= 2")
    data["kv_memory"] = _kv_memory(args, data.get("kv_memory"))
    if data["kv_memory"] is not None:
        if args.num_blocks is not None:
            where = "--kv-memory" if args.kv_memory is not None else "the config's kv_memory"
            raise ValueError(f"give --num-blocks or {where}, not both (the memory sizes the "
                             f"pool)")
        apply_kv_memory({"kv_memory": data["kv_memory"], "block_manager": bm})
    if sc["preemption"] == "swap" and not bm.get("num_host_blocks"):
        bm["num_host_blocks"] = bm["num_blocks"]
    if sc["preemption"] == "swap" and bm.get("num_slots") and args.num_host_slots is None \
            and not bm.get("num_host_slots"):
        bm["num_host_slots"] = bm["num_slots"]  # a hybrid sequence swaps its slot too
    if sc["preemption"] == "swap" and bm.get("num_slots") and not bm.get("num_host_slots"):
        raise ValueError("--hybrid --preemption swap needs --num-host-slots >= 1")
    for pages, slots in (("num_host_cache_blocks", "num_host_cache_slots"),
                         ("num_disk_blocks", "num_disk_slots")):
        if bm.get(pages) and bm.get("num_slots") and getattr(args, slots) is None \
                and not bm.get(slots):
            bm[slots] = bm["num_slots"]  # a hybrid prefix moves with its snapshot
    _check_pool_sizes(bm)
    if args.profile is not None:
        from scheduler.simulator.profile import read_cost

        cost = read_cost(args.profile).to_dict()
    if args.cost:
        cost.update(args.cost)
    data.update(workload=wl, block_manager=bm, scheduler=sc, cost=cost)
    if args.check is not None:
        data["check_every"] = args.check
    if args.sample_every is not None:
        data["sample_every"] = args.sample_every
    if args.trace is not None:
        if args.write_trace is not None:
            raise ValueError("--trace and --write-trace cannot be combined")
        if not Path(args.trace).is_file():
            raise ValueError(f"trace file not found: {args.trace}")
        data["trace"] = args.trace
    for opt in ("trace_block_tokens", "time_scale"):
        if getattr(args, opt) is not None:
            if data.get("trace") is None:
                raise ValueError(f"--{opt.replace('_', '-')} needs --trace")
            data[opt] = getattr(args, opt)
    return SimulationConfig.from_dict(data)


def _kv_memory(args, loaded: dict | None) -> dict | None:
    """The config's kv_memory section: `loaded` (a --config's, or None)
    with the --kv-memory, --kv-shape and format options applied. Raises
    ValueError for a format or shape without a memory, a memory without a
    shape, or values `KVMemory` refuses."""
    from scheduler.simulator.kv_memory import KVMemory

    fields = kv_format_fields(args)
    if args.kv_memory is None and args.kv_shape is None and fields is None:
        return loaded
    if loaded is None and args.kv_memory is None:
        given = "--kv-shape" if fields is None else "a --kv-*bits option"
        raise ValueError(f"{given} needs --kv-memory: the format and shape say how many pages a "
                         f"KV memory holds (without one the pool is --num-blocks pages)")
    section = dict(loaded or {})
    if args.kv_memory is not None:
        section["budget"] = parse_bytes(args.kv_memory)
    if args.kv_shape is not None:
        section["shape"] = args.kv_shape
    if fields is not None:
        section["format"] = fields
    if "shape" not in section:
        raise ValueError("--kv-memory needs the model's KV shape, e.g. --kv-shape layers=28,"
                         "kv_heads=8,head_dim=128,dtype=bfloat16 (its config.json's "
                         "num_hidden_layers, num_key_value_heads, head_dim, torch_dtype)")
    KVMemory.from_dict(section)  # refused here with the option's words, not later
    return section


#: The most tokens one traced request may have in its prompt or its output
#: (both are materialised: a bigger one is a broken trace, not a workload).
MAX_TRACE_REQUEST_TOKENS = 1 << 24


def check_trace(config) -> None:
    """Read the config's trace (with its block size and time scale) and
    refuse requests too large to simulate (ValueError, one line naming the
    request). Its warnings are reported when the run reads it."""
    from scheduler.simulator.trace import TraceError, TraceWarning, read_trace

    path = config.trace
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)
            _, sessions = read_trace(path, config.trace_block_tokens, config.time_scale)
    except (TraceError, UnicodeDecodeError) as exc:
        raise ValueError(f"trace {path}: {exc}") from None
    limit = MAX_TRACE_REQUEST_TOKENS
    for session in sessions:
        for spec in session:
            num_prompt = len(spec.tokens) if spec.tokens is not None else sum(
                length for _, length in spec.prompt)
            for what, count in (("prompt", num_prompt), ("output", spec.output_len)):
                if count > limit:
                    raise ValueError(
                        f"trace {path}: request {spec.request_id!r} has {count} {what} "
                        f"tokens, more than the {limit} a simulated request may have"
                    )


#: The most pages (or slots) one simulated pool may have: the bookkeeping
#: keeps a list entry per page (2**24 pages of 16 tokens hold 268M tokens).
MAX_POOL_ITEMS = 1 << 24


def _check_pool_sizes(bm: dict) -> None:
    for key in ("num_blocks", "num_host_blocks", "num_slots", "num_host_slots",
                "num_host_cache_blocks", "num_host_cache_slots", "num_disk_blocks",
                "num_disk_slots"):
        value = bm.get(key)
        if isinstance(value, int) and value > MAX_POOL_ITEMS:
            option = "--" + key.replace("_", "-")
            raise ValueError(
                f"{option} {value} is more than the {MAX_POOL_ITEMS} a simulated pool may have"
            )


def _load_config(path: str) -> dict:
    from scheduler.simulator.json_file import read_json

    data = read_json(path, "config")
    if isinstance(data, dict) and "config" in data and "summary" in data:
        data = data["config"]  # a report.json
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a JSON object")
    return data


# ------------------------------------------------------------------ running


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None, None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=total, unit="req", desc="simulating", file=sys.stderr, dynamic_ncols=True)
    state = {"done": 0}

    def update(done: int, submitted: int, sim_time: float) -> None:
        bar.update(done - state["done"])
        state["done"] = done
        bar.set_postfix_str(f"t={sim_time:,.0f}s sim", refresh=False)

    return bar, update


def _total_requests(config) -> int:
    """Requests the run will submit (a trace is read, and validated, once more)."""
    if config.trace is None:
        return config.workload.num_requests
    from scheduler.simulator.trace import TraceWarning, read_trace

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        _, sessions = read_trace(config.trace, config.trace_block_tokens, config.time_scale)
    for warning in caught:
        print(f"blockmgr: warning: {warning.message}", file=sys.stderr)
    return sum(len(session) for session in sessions)


def cmd_simulate(args) -> int:
    from scheduler.simulator.runner import run_simulation
    from scheduler.simulator.trace import write_trace
    from scheduler.simulator.workloads import generate

    config = build_config(args)
    if config.trace is not None:
        check_trace(config)
    if args.sweep is not None:
        return cmd_sweep(args, config)
    for option in ("jobs", "ray"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option} only applies to --sweep")
    if args.write_trace is not None:
        try:
            write_trace(args.write_trace, generate(config.workload),
                        {"vocab_size": config.vocab_size, "workload": config.workload.to_dict()})
        except OSError as exc:
            raise ValueError(f"cannot write trace {args.write_trace}: {exc.strerror}") from None
    fleet = fleet_of(args)
    if fleet is not None:
        from scheduler.simulator.fleet import run_fleet
        from scheduler.simulator.fleet_report import fleet_rows, write_fleet_report

        result = _run_with_progress(args, config,
                                    lambda update: run_fleet(config, fleet, progress=update))
        return _write_and_print(args, result, "blockmgr simulate (fleet)",
                                write=write_fleet_report, rows=fleet_rows)
    result = _run_with_progress(args, config, lambda update: run_simulation(config, progress=update))
    return _write_and_print(args, result, "blockmgr simulate")


def fleet_of(args):
    """The fleet `--replicas`, `--router`, `--cores`, `--background`,
    `--step-jitter` and `--fleet-seed` ask for (None: one server)."""
    if args.replicas is None and args.router is None and args.cores is None \
            and args.step_jitter is None:
        if args.background is not None:
            raise ValueError("--background needs --cores (the machine the replicas share)")
        if args.fleet_seed is not None:
            raise ValueError("--fleet-seed needs --step-jitter (the draws it seeds)")
        return None
    from scheduler.simulator.fleet import FleetSpec

    return FleetSpec(args.replicas or 1, args.router or "round_robin", args.cores,
                     args.background or 0.0, args.step_jitter or 0.0, args.fleet_seed or 0)


def cmd_replay(args) -> int:
    from scheduler.simulator.engine_models import load_model, vocab_size
    from scheduler.simulator.replay import run_replay

    if args.write_trace is not None:
        raise ValueError("--write-trace applies to simulate; replay a written trace with --trace")
    config = build_config(args)
    model, description = load_model(_model_spec(args))
    if config.vocab_size > vocab_size(description):
        from scheduler.simulator.config import SimulationConfig

        config = SimulationConfig.from_dict({**config.to_dict(), "vocab_size": vocab_size(description)})
    result = _run_with_progress(args, config,
                                lambda update: run_replay(config, model, description, progress=update,
                                                          clock=args.clock))
    return _write_and_print(args, result, "blockmgr replay")


def _model_spec(args):
    from scheduler.simulator.engine_models import ModelSpec

    return ModelSpec(path=args.model, preset=args.preset, layers=args.layers, shape=args.shape or {})


def _run_with_progress(args, config, run):
    """`run(progress_callback)` under a progress bar; trace errors become ValueError."""
    from scheduler.simulator.trace import TraceError, TraceWarning

    show = not args.no_progress and sys.stderr.isatty()
    try:
        bar, update = _progress_bar(_total_requests(config), show)
        try:
            with warnings.catch_warnings():  # _total_requests has reported them
                warnings.simplefilter("ignore", TraceWarning)
                return run(update)
        finally:
            if bar is not None:
                bar.close()
    except TraceError as exc:
        raise ValueError(str(exc)) from None


def _write_and_print(args, result, title: str, write=None, rows=None) -> int:
    """Write the report folder (`write`, default the simulator's) and print
    its table (`rows` of the summary, default `summary_rows`)."""
    from scheduler.simulator.report import format_table, summary_rows, write_report

    write, rows = write or write_report, rows or summary_rows
    out_dir = Path(args.out or DEFAULT_OUT)
    try:
        folder, plots, note = write(result, out_dir, plots=not args.no_plots)
    except OSError as exc:
        raise ValueError(f"cannot write the report to {out_dir}: {exc.strerror}") from None
    if note:
        print(f"blockmgr: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.summary, indent=1))
    else:
        print(format_table(rows(result.summary), title))
        print(f"report: {folder / 'report.md'} ({len(plots)} plots), {folder / 'report.json'}")
    return 0


def _bar_progress(bar: Any) -> Callable[[str], None] | None:
    """A calibration progress callback advancing a tqdm `bar` (None without one)."""
    if bar is None:
        return None

    def progress(label: str) -> None:
        bar.update(1)
        bar.set_postfix_str(label)

    return progress


def cmd_calibrate(args) -> int:
    from dataclasses import replace

    from scheduler.simulator.calibrate import QUICK_GRID, CalibrationGrid, calibrate
    from scheduler.simulator.engine_models import load_model
    from scheduler.simulator.profile import write_profile

    grid = QUICK_GRID if args.quick else CalibrationGrid()
    if args.repeats is not None:
        grid = replace(grid, repeats=args.repeats)
    model, description = load_model(_model_spec(args))
    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=grid.num_points, unit="point", desc="calibrating", file=sys.stderr)
    try:
        profile = calibrate(model, description, grid, progress=_bar_progress(bar),
                            clock=args.clock, disk_cache=args.disk_cache)
    finally:
        if bar is not None:
            bar.close()
    try:
        write_profile(args.out, profile)
    except OSError as exc:
        raise ValueError(f"cannot write the profile {args.out}: {exc.strerror}") from None
    fit, blas = profile.fit, profile.machine["blas"]
    print(f"blockmgr calibrate: {fit['num_steps']} steps, per-step error median "
          f"{fit['median_abs_rel_error'] * 100:.1f} %, mean {fit['mean_abs_rel_error'] * 100:.1f} %; "
          f"BLAS {blas['name']} ({blas['matmul_1024_gflops']:.0f} GFLOPS)")
    worst = sorted(fit["points"], key=lambda p: -abs(p["rel_error"]))[:3]
    print("blockmgr calibrate: worst grid points (mean step, predicted vs measured): "
          + ", ".join(f"{p['label']} {p['rel_error'] * 100:+.1f} %" for p in worst))
    if not blas["optimized"]:
        print("blockmgr calibrate: warning: MLX runs on the reference BLAS; preload an optimized "
              "one (LD_PRELOAD=.../libopenblas.so.0) for realistic figures", file=sys.stderr)
    _print_tier_moves(profile.grid["tier_moves"])
    print(f"profile: {args.out}")
    return 0


def _print_tier_moves(moves: dict) -> None:
    """One line: the tier moves `blockmgr calibrate` timed (per page) and
    the bandwidths they imply."""
    mib = 2**20
    print(f"blockmgr calibrate: tier moves per page of {moves['record_nbytes']} bytes: host "
          f"{moves['host_move_per_page'] * 1e6:.1f} us ({moves['host_copy_bytes_per_s'] / mib:.0f}"
          f" MiB/s), disk store {moves['disk_store_per_page'] * 1e6:.1f} us, disk load "
          f"{moves['disk_load_per_page'] * 1e6:.1f} us; disk write "
          f"{moves['disk_write_bytes_per_s'] / mib:.0f} MiB/s, read "
          f"{moves['disk_read_bytes_per_s'] / mib:.0f} MiB/s"
          f"{'' if moves['cold_reads'] else ' (reads may come from the OS cache)'}")


def cmd_compare(args) -> int:
    from scheduler.simulator.report import comparison_rows, format_comparison

    summaries = [_load_summary(path) for path in args.reports]
    rows = comparison_rows(*summaries)
    if args.json:
        print(json.dumps([dict(zip(("metric", "first", "second", "difference"), r)) for r in rows],
                         indent=1))
    else:
        print(format_comparison(rows, *args.reports))
    return 0


def _load_summary(path: str) -> dict:
    target = Path(path)
    from scheduler.simulator.json_file import read_json

    if target.is_dir():
        target = target / "report.json"
    data = read_json(target, "report")
    if not isinstance(data, dict) or "summary" not in data:
        raise ValueError(f"{target} is not a report.json (no summary)")
    return data["summary"]


def cmd_sweep(args, base) -> int:
    from scheduler.simulator.sweep import (
        DEFAULT_GRID, format_text_table, grid_points, parse_grid, run_sweep, table_rows, write_sweep,
    )

    if args.trace is None and args.write_trace is not None:
        raise ValueError("--write-trace cannot be combined with --sweep")
    spec = DEFAULT_GRID if args.sweep == "default" else args.sweep
    grid = parse_grid(spec)
    if args.num_requests is None and args.config is None and "num_requests" not in grid:
        data = base.to_dict()
        data["workload"]["num_requests"] = 1000  # a sweep runs many points
        from scheduler.simulator.config import SimulationConfig

        base = SimulationConfig.from_dict(data)
    points = grid_points(base, grid, parse_mix)
    for params, point in points:
        try:
            _check_pool_sizes(dataclasses.asdict(point.block_manager))
        except ValueError as exc:
            raise ValueError(f"sweep point {params}: {exc}") from None
    jobs = args.jobs or 2
    show = not args.no_progress and sys.stderr.isatty()
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(points), unit="run", desc="sweep", file=sys.stderr)
        except ImportError:
            bar = None
    rows = run_sweep(points, jobs=jobs, on_done=(lambda row: bar.update(1)) if bar else None,
                     ray_address=args.ray, fleet=fleet_of(args))
    if bar is not None:
        bar.close()
    names = list(grid)
    out_dir = Path(args.out or DEFAULT_OUT)
    folder, note = write_sweep(rows, names, out_dir, plots=not args.no_plots)
    if note:
        print(f"blockmgr: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps([{"params": r["params"], "summary": r["summary"]} for r in rows], indent=1))
    else:
        header, body = table_rows(rows, names)
        print(format_text_table(header, body))
        print(f"sweep: {folder / 'sweep.md'}, {folder / 'sweep.json'}")
    return 0


def cmd_serve(args) -> int:
    """Load the model, size the pool, serve until SIGINT/SIGTERM."""
    from scheduler.serving import serve

    fields = kv_format_fields(args)  # bad options fail before the model loads
    kv_format = None if fields is None else KVFormat(**fields)
    dirs = [args.model] + ([args.draft_model] if args.draft_model else [])
    budget = None if args.num_blocks else serve.kv_budget(args.kv_memory, dirs,
                                                           args.kv_memory_fraction)
    tiers = serve.cache_tier_options(args.disk_cache, args.disk_cache_size, args.host_cache_size)
    max_body_bytes = None if args.max_body_size is None else parse_bytes(args.max_body_size)
    endpoint, bind = serve.kv_events_endpoint(args.kv_events, args.kv_events_bind)
    warning = serve.kv_events_warning(endpoint, args.kv_events_replay, bind)
    if warning:
        print(f"blockmgr serve: {warning}", file=sys.stderr)
    kv_events = serve.open_kv_events(endpoint, args.kv_events_topic, args.kv_events_replay,
                                     bind=bind)
    config = serve.serve_config(kv_format=kv_format, **tiers, **serve_settings(args),
                                **serve_speculation(args))
    engine, name = serve.load_engine(args.model, config, budget=budget,
                                     draft_model=args.draft_model, kv_events=kv_events)
    hint = serve.blas_hint()
    if hint:
        print(hint, file=sys.stderr)
    serve.touch_pool(engine)
    size = serve.engine_pool(engine)
    pool = serve.pool_line(size, engine.cache.kv_format, args.block_size)
    print(f"blockmgr serve: {name}: {pool}", file=sys.stderr)
    print(f"blockmgr serve: {name}: {startup_line(engine, budget)}, max model length "
          f"{engine.scheduler.config.max_model_len} tokens, on http://{args.host}:{args.port}",
          file=sys.stderr)
    options = None if budget is None else serve.simulate_options(
        engine.model, size, engine.cache.kv_format, args.block_size,
        args.kv_memory or str(budget.nbytes))
    if options is not None:
        context = min(engine.scheduler.config.max_model_len, size.num_blocks * args.block_size)
        print(f"blockmgr serve: the same pool in the simulator: blockmgr simulate {options} "
              f"--max-num-seqs {args.max_num_seqs} --max-context {context}", file=sys.stderr)
    serve.run(engine, args.served_model_name or name, host=args.host, port=args.port,
              max_waiting=args.max_waiting, graceful_seconds=args.shutdown_timeout,
              max_body_bytes=max_body_bytes, allow_cache_reset=args.enable_prefix_cache_reset,
              status_interval=args.status_interval or None, grpc_port=args.grpc_port,
              model_dir=args.model)
    return 0


def startup_line(engine, budget) -> str:
    """The pool as allocated (its real bytes), where its size came from,
    and the process's peak resident memory."""
    from scheduler.serving import serve

    cache, nbytes = engine.cache, engine.cache.nbytes
    slots = f", {cache.num_slots} recurrent slots" if cache.num_slots else ""
    each = "" if slots else f", {nbytes / cache.num_blocks / 2**10:.1f} KiB each"
    source = "--num-blocks" if budget is None else budget.describe()
    return (f"KV pool {nbytes / 2**30:.2f} GiB allocated ({cache.num_blocks} "
            f"pages of {cache.block_size} tokens{each}{slots}; sized by {source}), "
            f"peak resident memory {serve.peak_rss() / 2**30:.2f} GiB")


def serve_settings(args) -> dict:
    """`serve_config` keywords of serve's engine settings (`SERVED_SETTINGS`
    but the cache tiers, which `serve.cache_tier_options` checks): those
    given or defaulted to a value."""
    tiers = ("disk_cache", "disk_cache_size", "host_cache_size")
    return {name: getattr(args, name) for name in SERVED_SETTINGS
            if name not in tiers and getattr(args, name) is not None}


def serve_speculation(args) -> dict:
    """`serve_config` keywords of `--num-speculative-tokens` (with `--draft-model`)."""
    if args.draft_model is None:
        return {}
    return {"num_speculative_tokens": args.num_speculative_tokens}


def cmd_bench(args) -> int:
    """Replay the workload against `--url` and write the report."""
    from blockmgr.errors import InvalidArgument
    from scheduler.serving.bench_checks import load_warnings
    from scheduler.serving.bench_report import bench_rows, write_bench_report
    from scheduler.serving.loadgen import BenchOptions, run_bench
    from scheduler.simulator.runner import sessions_of
    from scheduler.simulator.trace import TraceError

    if args.write_trace is not None:
        raise ValueError("--write-trace applies to simulate; bench a written trace with --trace")
    time_scale, args.time_scale = args.time_scale or 1.0, None  # bench scales every workload
    config = build_config(args)
    if args.vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=args.vocab_size)
    try:
        options = BenchOptions(args.url, model=args.model, api=args.api,
                               prompt_format=args.prompt_format, time_scale=time_scale,
                               timeout=args.timeout, ignore_eos=not args.no_ignore_eos,
                               api_key=args.api_key,
                               cache_salt=f"run-{uuid.uuid4().hex[:12]}" if args.fresh_cache
                               else None)
        sessions = list(sessions_of(config))
    except (InvalidArgument, TraceError) as exc:
        raise ValueError(str(exc)) from None
    total = sum(len(s) for s in sessions)
    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc=f"bench {args.url}", file=sys.stderr)
    try:
        result = run_bench(config, options, sessions,
                           on_done=(lambda outcome: bar.update(1)) if bar is not None else None)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    finally:
        if bar is not None:
            bar.close()
    _write_and_print(args, result, f"blockmgr bench {options.base}", write_bench_report,
                     bench_rows)
    for line in load_warnings(result.summary["load"]):
        print(f"blockmgr bench: warning: {line}", file=sys.stderr)
    failed = result.summary["requests"]["aborted"]
    if failed:
        print(f"blockmgr bench: warning: {failed} of {total} requests failed", file=sys.stderr)
    return 0 if failed < total else 1


COMMANDS = {"simulate": cmd_simulate, "replay": cmd_replay, "calibrate": cmd_calibrate,
            "compare": cmd_compare, "serve": cmd_serve, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    raise SystemExit(main())
