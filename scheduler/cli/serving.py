"""The serving commands: serve (an OpenAI-compatible server over the
engine) and bench (a workload against any such server)."""

from __future__ import annotations

import dataclasses
import sys
import uuid

from blockmgr.kv_format import KVFormat, parse_bytes
from scheduler.cli.config import build_config
from scheduler.cli.options import SERVED_SETTINGS, kv_format_fields
from scheduler.cli.simulate import progress_bar, write_and_print


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
    bar = progress_bar(args, total, "req", f"bench {args.url}")
    try:
        result = run_bench(config, options, sessions,
                           on_done=(lambda outcome: bar.update(1)) if bar is not None else None)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    finally:
        if bar is not None:
            bar.close()
    write_and_print(args, result, f"blockmgr bench {options.base}", write_bench_report,
                    bench_rows)
    for line in load_warnings(result.summary["load"]):
        print(f"blockmgr bench: warning: {line}", file=sys.stderr)
    failed = result.summary["requests"]["aborted"]
    if failed:
        print(f"blockmgr bench: warning: {failed} of {total} requests failed", file=sys.stderr)
    return 0 if failed < total else 1
