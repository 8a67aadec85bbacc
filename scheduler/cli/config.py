"""The `SimulationConfig` a command line describes (`build_config`): a
--config file or the defaults, the options applied, sizes and traces
checked; every refusal a one-line `ValueError`."""

from __future__ import annotations

import warnings
from pathlib import Path

from blockmgr.kv_format import parse_bytes
from scheduler.cli.options import SCHEDULER_OPTIONS, kv_format_fields
from scheduler.simulator.kv_memory import engine_num_slots
from scheduler.simulator.layout import ModelLayout, layout_named


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
    check_pool_sizes(bm)
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


def check_pool_sizes(bm: dict) -> None:
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
