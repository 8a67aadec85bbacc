"""The options of every subcommand: `build_parser`. The engine's settings
are generated from their declarations (`scheduler.engine.config`), each with
its one name, help, bounds and choices."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from blockmgr.kv_format import BITS, DEFAULT_GROUP_SIZE
from scheduler.cli.arguments import (
    Parser,
    cost_overrides,
    int_at_least,
    key_values,
    length_dist,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    workload_mix,
)
from scheduler.engine.config import settings
from scheduler.serving.serve import KV_MEMORY_FRACTION, SERVE_DEFAULTS
from scheduler.serving.status import DEFAULT_STATUS_INTERVAL
from scheduler.simulator.layout import LAYOUTS
from scheduler.simulator.workloads import WORKLOAD_KINDS

#: The report folder of simulate, replay and bench unless --out names one.
DEFAULT_OUT = "blockmgr-report"
#: Steps between integrity checks of a bare --check.
DEFAULT_CHECK_EVERY = 256


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="blockmgr", description="Paged KV cache manager tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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
    r.add_argument("--cost", type=cost_overrides, metavar="K=S,...",
                   help="cost model seconds, e.g. step_overhead=0.01,decode_per_token=0.0005")
    r.add_argument("--profile", metavar="FILE",
                   help="cost model from a `blockmgr calibrate` profile (--cost still overrides); "
                        "its model's layout too, unless --layout, --sliding-window or --config "
                        "gives one")
    r.add_argument("--sweep", nargs="?", const="default", metavar="GRID",
                   help="run a grid, e.g. 'num_blocks=1024,4096;block_size=16,32' (default grid "
                        "if no value)")
    r.add_argument("--jobs", type=positive_int, help="sweep worker processes (default 2)")
    r.add_argument("--ray", metavar="ADDRESS",
                   help="run the sweep on a Ray cluster (an address, or 'local' to start one here; "
                        "needs the ray extra)")
    r.add_argument("--replicas", type=positive_int, metavar="N",
                   help="simulate a fleet of N such servers behind --router (sweep: replicas=...)")
    r.add_argument("--router", metavar="POLICY", help="the fleet's router: round_robin (default), "
                   "least_load, cache_aware, precise (sweep: router=...)")
    r.add_argument("--cores", type=positive_float, metavar="C",
                   help="the fleet's replicas share one machine of C cores, a step in flight "
                        "beside others ending later than priced (default: a machine each)")
    r.add_argument("--background", type=nonneg_float, metavar="B",
                   help="with --cores: B runnable threads of other work share those cores "
                        "(default 0)")
    r.add_argument("--step-jitter", type=nonneg_float, metavar="SIGMA",
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
    cal.add_argument("--quick", action="store_true",
                     help="a small grid (about a minute on a small model)")
    cal.add_argument("--repeats", type=positive_int,
                     help="measure the grid this many times (default 2)")
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
    g.add_argument("--layers", type=positive_int, metavar="N", help="keep the first N layers")
    g.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by the wall clock (default) or by this process's CPU time, "
                        "which leaves out other processes' use of a shared machine")
    g.add_argument("--shape", type=key_values, metavar="K=V,...",
                   help="preset config fields to replace, e.g. hidden_size=256,vocab_size=32000")


def _add_workload_options(parser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", type=workload_mix, metavar="MIX",
                   help="kinds, optionally weighted: chat | chat,agent | chat=0.7,multiturn=0.3 "
                        "| all "
                        f"(kinds: {', '.join(WORKLOAD_KINDS)}; default all, equal weights)")
    w.add_argument("-n", "--num-requests", type=positive_int, metavar="N",
                   help="requests in total (default 2000)")
    w.add_argument("--seed", type=nonneg_int, help="workload seed (default 0)")
    w.add_argument("--arrival", choices=("poisson", "closed"),
                   help="open-loop Poisson or closed loop")
    w.add_argument("--rate", type=positive_float,
                   help="Poisson: new sessions per simulated second (default 1)")
    w.add_argument("--concurrency", type=positive_int, help="closed loop: clients (default 64)")
    w.add_argument("--system-len", type=length_dist, metavar="DIST",
                   help="system prompt length, e.g. fixed:512")
    w.add_argument("--user-len", type=length_dist, metavar="DIST",
                   help="user message length, e.g. lognormal:mean=120")
    w.add_argument("--output-len", type=length_dist, metavar="DIST",
                   help="output length (chat-like kinds)")
    w.add_argument("--turns", type=length_dist, metavar="DIST",
                   help="multiturn: turns per conversation")
    w.add_argument("--agent-steps", type=length_dist, metavar="DIST", help="agent: steps per loop")
    w.add_argument("--tool-output-len", type=length_dist, metavar="DIST",
                   help="agent: tool output length")
    w.add_argument("--think-time", type=nonneg_float, metavar="S",
                   help="multiturn: mean think time")
    w.add_argument("--tool-time", type=nonneg_float, metavar="S", help="agent: mean tool latency")
    w.add_argument("--max-context", type=positive_int, metavar="TOKENS",
                   help="session context cap (default 8192)")
    w.add_argument("--num-system-prompts", type=positive_int, metavar="K")
    w.add_argument("--num-tenants", type=positive_int, metavar="K", help="tenants: namespaces")
    w.add_argument("--samples", type=positive_int, metavar="N",
                   help="parallel: samples per request (default 4)")
    w.add_argument("--trace", metavar="FILE", help="replay a JSONL trace instead of generating")
    w.add_argument("--write-trace", metavar="FILE", help="write the generated workload as a trace")
    w.add_argument("--trace-block-tokens", type=positive_int, metavar="TOKENS",
                   help="tokens per prefix-id (hash_ids) block of the trace (default: its header, "
                        "else 512 as in Mooncake traces)")
    w.add_argument("--time-scale", type=positive_float, metavar="F",
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
    m.add_argument("--sliding-window", type=positive_int, metavar="TOKENS",
                   help="window of the layout's sliding layers (alone: every layer sliding)")
    add("num_host_blocks", default_text="with swap: num blocks")
    add("num_host_slots", default_text="with --hybrid and swap: num slots")
    m.add_argument("--num-host-cache-blocks", type=nonneg_int,
                   help="pages of the prefix cache's host tier (default 0: none; design/tiers.md)")
    m.add_argument("--num-host-cache-slots", type=nonneg_int,
                   help="recurrent snapshots of the host tier (default with --hybrid: num slots)")
    m.add_argument("--num-disk-blocks", type=nonneg_int,
                   help="pages of the prefix cache's disk tier (default 0: none)")
    m.add_argument("--num-disk-slots", type=nonneg_int,
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
        return nonneg_float if setting.minimum == 0 else positive_float
    if isinstance(setting.minimum, int):
        return int_at_least(setting.minimum)
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
    k.add_argument("--kv-shape", type=key_values, metavar="K=V,...",
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
    """simulate's and replay's run and report options (returned: the group)."""
    r = parser.add_argument_group("run and report")
    r.add_argument("--check", nargs="?", const=DEFAULT_CHECK_EVERY, type=positive_int, metavar="K",
                   help=f"check_integrity() every K steps (default {DEFAULT_CHECK_EVERY}) and a "
                        "leak check at the end")
    r.add_argument("--sample-every", type=positive_int, metavar="STEPS",
                   help="memory snapshot interval (default 32)")
    _add_report_options(r)
    return r


def _add_report_options(group) -> None:
    """The options of a run's report (simulate, replay, bench): config, folder,
    plots, progress, JSON."""
    group.add_argument("--config", metavar="FILE",
                       help="start from a config (or a report.json) and apply options")
    group.add_argument("--out", metavar="DIR", help=f"report folder (default ./{DEFAULT_OUT})")
    group.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument("--json", action="store_true",
                       help="print the summary as JSON (nothing else on stdout)")


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve an mlx-lm model directory over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics) over the paged engine. See design/serving.md.",
    )
    serve.add_argument("--model", required=True, metavar="DIR", help="mlx-lm model directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int_at_least(0), default=8000, help="port (default 8000)")
    serve.add_argument("--kv-memory", metavar="SIZE",
                       help="KV memory, e.g. 4GiB or 512MB: a hybrid model's recurrent slots "
                            "first, pages with the rest (default: --kv-memory-fraction of the "
                            "memory available at start, after the weights); allocated at start")
    serve.add_argument("--kv-memory-fraction", type=float, default=KV_MEMORY_FRACTION,
                       metavar="F", help=f"share of the available memory the KV pool takes "
                                         f"without --kv-memory (default {KV_MEMORY_FRACTION})")
    serve.add_argument("--status-interval", type=nonneg_float, default=DEFAULT_STATUS_INTERVAL,
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
    serve.add_argument("--max-waiting", type=positive_int, default=256,
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
    serve.add_argument("--shutdown-timeout", type=nonneg_float, default=10.0, metavar="SECONDS",
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
    serve.add_argument("--grpc-port", type=int_at_least(0), metavar="PORT",
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
    b.add_argument("--vocab-size", type=int_at_least(2), metavar="V",
                   help="token ids drawn from [0, V) (default 32000; tokens prompts must fit the "
                        "server's vocabulary)")
    b.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="one request's time limit (default 600)")
    b.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (outputs may end before max_tokens)")
    b.add_argument("--api-key", help="sent as a bearer token")
    b.add_argument("--fresh-cache", action="store_true",
                   help="send a new cache_salt this run: a server that honours it (blockmgr "
                        "serve, vLLM) cannot answer from an earlier run's prefix cache")
    _add_workload_options(bench)
    _add_report_options(bench.add_argument_group("run and report"))
    scratch = Parser(add_help=False)
    _add_pool_options(scratch)
    bench.set_defaults(**vars(scratch.parse_args([])), check=None, sample_every=None, cost=None,
                       profile=None, **KV_DEFAULTS)
