"""The simulated fleet against the real one: three `blockmgr serve` replicas
behind the Shepherd Model Gateway and `blockmgr simulate`'s fleet of the
same replicas, on the same requests, in one run.

Real (benchmarks/fleet_gateway.py's fleet): per SMG policy a fresh fleet of
`--replicas` replicas of a small Qwen3-shaped model (cold caches), each
replica's BLAS on `--blas-threads` threads, and `blockmgr bench` through
the gateway on the multi-session workload (closed loop). Recorded: prompt
and cached tokens (the replicas' /metrics), throughput, TTFT and TPOT (the
client's), the requests each replica finished, and the CPU seconds each
replica, the gateway and the client used (/proc, getrusage); the load
average before and after.

Simulated: the same sessions (the bench's own `sessions_of`), with each
prompt replaced by the token ids the replicas' tokenizer makes of the chat
the bench sends (`loadgen.served_sessions`: template tokens included; a
follow-up quotes the workload's answer, the replica cached its model's
own), on the replicas' pool (the options `blockmgr serve` prints for it)
and scheduler limits, priced by a cost profile calibrated on this model
(`blockmgr calibrate --clock cpu`, one BLAS thread: the CPU time of a
step with a core to itself), behind the simulator's router of the same
name (`cache_aware` with the gateway's `--cache-threshold`, 0.3). Twice:
every replica with a machine of its own, and the replicas sharing
`--cores` cores (`FleetSpec.cores`, processor sharing), which is how the
real replicas run here.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/fleet_predict.py --requests 96 --out /tmp/fleet-predict

The issue's tolerance: hit rate within 2 points, throughput and TPOT p50
within 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_gateway import (  # noqa: E402
    add_fleet_options,
    build_model,
    counter,
    workload_args,
)
from tests.fleet import Fleet, httpx  # noqa: E402

#: SMG policy -> the simulator's router of the same rule.
ROUTER_OF = {"round_robin": "round_robin", "cache_aware": "cache_aware"}
#: SMG 1.13's `--cache-threshold` default (the gateway is launched without it).
SMG_CACHE_THRESHOLD = 0.3
SIMULATE_LINE = re.compile(r"the same pool in the simulator: blockmgr simulate (.*)$", re.MULTILINE)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_seconds() -> tuple[float, float, float]:
    """(busy, steal, elapsed) CPU seconds of the whole machine so far, over
    every core (/proc/stat's first line): busy is user + nice + system +
    irq + softirq, steal the time the hypervisor gave another guest."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    tick = os.sysconf("SC_CLK_TCK")
    return ((user + nice + system + irq + softirq) / tick, steal / tick, sum(values) / tick)


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a live process's threads, by thread id."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def load_average() -> float:
    return os.getloadavg()[0]


def pool_options(log: str) -> list[str]:
    """The simulate options a replica printed for its pool (its
    --max-context only shapes generated workloads: dropped)."""
    match = SIMULATE_LINE.search(log)
    if match is None:
        raise RuntimeError("the replica printed no simulate options line")
    words = match.group(1).split()
    if "--max-context" in words:
        i = words.index("--max-context")
        del words[i:i + 2]
    return words


def smg_branches(text: str) -> dict[str, float]:
    """SMG's cache-aware decisions by branch (its Prometheus
    `smg_cache_aware_policy_branch_total`): hits, misses, spills, warm-up."""
    out: dict[str, float] = {}
    for match in re.finditer(r'^smg_cache_aware_policy_branch_total\{[^}]*branch="([^"]+)"'
                             r'[^}]*\} ([0-9.e+]+)$', text, re.MULTILINE):
        out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
    return out


def run_real(args: argparse.Namespace, model_dir: Path, policy: str, out: Path,
             run: int = 0) -> dict:
    serve_args = ("--kv-memory", args.kv_memory, "--block-size", "16",
                  "--max-num-seqs", str(args.concurrency), "--status-interval", "0")
    if args.prefill_batch is not None:
        serve_args += ("--prefill-batch", str(args.prefill_batch))
    with Fleet(model_dir, args.replicas, policy, out / "logs", serve_args=serve_args,
               timeout=300) as fleet:
        pids = [p.pid for p in fleet.procs]  # the replicas, then the gateway
        before = [cpu_seconds(pid) for pid in pids]
        threads_before = [thread_cpu_seconds(pid) for pid in pids[:-1]]
        load_before = load_average()
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        machine_before = machine_seconds()
        cmd = [sys.executable, "-m", "scheduler.cli", "bench", "--url", fleet.url,
               "--model", "model", *workload_args(args), "--vocab-size", str(args.vocab),
               "--out", str(out / "bench"), "--no-progress", "--no-plots", "--json"]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - start
        client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        machine_after = machine_seconds()
        after = [cpu_seconds(pid) for pid in pids]
        used = [{tid: t - b.get(tid, 0.0) for tid, t in thread_cpu_seconds(pid).items()}
                for pid, b in zip(pids, threads_before)]
        # A replica's main thread runs its event loop (HTTP, SSE, the server's
        # own work); its steps run on the engine thread and MLX's compute thread.
        threads = [{"main": round(u.get(str(pid), 0.0), 2),
                    "others": sorted((round(t, 2) for tid, t in u.items()
                                      if tid != str(pid) and t > 0.05), reverse=True)}
                   for pid, u in zip(pids, used)]
        load_after = load_average()
        metrics = [httpx.get(url + "/metrics", timeout=10).text for url in fleet.replica_urls]
        branches = smg_branches(httpx.get(fleet.metrics_url, timeout=10).text)
        options = pool_options(fleet.replica_log(0))
    summary = json.loads((out / "bench" / "report.json").read_text())["summary"]
    prompt = sum(counter(m, "blockmgr_prompt_tokens_total") for m in metrics)
    cached = sum(counter(m, "blockmgr_cached_prompt_tokens_total") for m in metrics)
    cpu = [a - b for a, b in zip(after, before)]
    client = (client_after.ru_utime + client_after.ru_stime
              - client_before.ru_utime - client_before.ru_stime)
    busy, steal, _ = (a - b for a, b in zip(machine_after, machine_before))
    others = max(0.0, busy - sum(cpu) - client)  # other people's jobs, this script
    # What the replicas had: the cores less what other jobs, the hypervisor,
    # the gateway and the client took. (A replica's own threads are all its
    # steps': MLX computes on a thread of its own, the engine thread
    # schedules, samples and streams; the profile timed them all.)
    free_cores = (os.cpu_count() or 1) - (others + steal + cpu[-1] + client) / wall
    return {"policy": policy, "source": "real" if run == 0 else f"real, run {run + 1}",
            "prompt_tokens": prompt, "smg_branches": branches,
            "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "requests_per_s": summary["throughput"]["requests_per_s"],
            "ttft_p50_s": summary["latency"]["ttft_s"]["p50"],
            "ttft_p90_s": summary["latency"]["ttft_s"]["p90"],
            "tpot_p50_s": summary["latency"]["tpot_s"]["p50"],
            "requests_per_replica": [counter(m, "blockmgr_requests_finished_total")
                                     for m in metrics],
            "cpu_s_per_replica": cpu[:-1], "gateway_cpu_s": cpu[-1], "client_cpu_s": client,
            "wall_s": wall, "load": [load_before, load_after], "others_cpu_s": others,
            "steal_s": steal, "free_cores": free_cores, "replica_threads_cpu_s": threads,
            "finished": summary["requests"]["finished"], "pool_options": options}


def sim_config(args: argparse.Namespace, options: list[str], profile: Path):
    """The replicas' SimulationConfig, built by the CLI's own option parsing."""
    from scheduler.cli import build_config, build_parser

    argv = ["simulate", *workload_args(args), *options, "--profile", str(profile)]
    config = build_config(build_parser().parse_args(argv))
    return replace(config, vocab_size=args.vocab)  # bench --vocab-size


def served(args: argparse.Namespace, config, model_dir: Path) -> list:
    """The bench's sessions as the replicas tokenize them."""
    from mlx_lm.utils import load_tokenizer

    from scheduler.engine.text import TextCodec
    from scheduler.serving.loadgen import BenchOptions, PromptBuilder, served_sessions
    from scheduler.simulator.runner import sessions_of

    codec = TextCodec(load_tokenizer(model_dir))
    builder = PromptBuilder(config.vocab_size, BenchOptions("http://bench", model="model"))
    return served_sessions(sessions_of(config), builder, codec.encode)


def fit_background(args: argparse.Namespace, config, sessions: list, policy: str,
                   used: float, jitter: float = 0.0, seed: int = 0) -> float:
    """The count of runnable background threads whose CPU use in the
    simulated run (`FleetSpec.background`) is `used` cores on average: what
    the other work (other jobs, the hypervisor, the gateway, the client) was
    measured to use. Bisection."""
    from scheduler.simulator.fleet import FleetSpec, run_fleet
    from scheduler.simulator.routers import RouterSettings

    settings = RouterSettings(args.replicas, config.block_manager.num_blocks,
                              config.block_manager.block_size,
                              cache_threshold=SMG_CACHE_THRESHOLD)
    low, high = 0.0, 32.0
    for _ in range(14):
        mid = (low + high) / 2
        fleet = FleetSpec(args.replicas, ROUTER_OF[policy], args.cores, mid, jitter, seed)
        machine = run_fleet(config, fleet, sessions, settings=settings).summary["machine"]
        if machine["background_cpu_s"] / machine["seconds"] < used:
            low = mid
        else:
            high = mid
    return round((low + high) / 2, 2)


def run_sim(args: argparse.Namespace, config, sessions: list, policy: str,
            cores: float | None, background: float = 0.0, seed: int = 0,
            jitter: float = 0.0) -> dict:
    from scheduler.simulator.fleet import FleetSpec, run_fleet
    from scheduler.simulator.routers import RouterSettings

    settings = RouterSettings(args.replicas, config.block_manager.num_blocks,
                              config.block_manager.block_size,
                              cache_threshold=SMG_CACHE_THRESHOLD, seed=seed)
    start = time.process_time()
    fleet = FleetSpec(args.replicas, ROUTER_OF[policy], cores, background, jitter, seed)
    result = run_fleet(config, fleet, sessions, settings=settings)
    cpu = time.process_time() - start
    s = result.summary
    prefix = s["prefix_cache"]
    prompt = sum(r.metrics.request_arrays()["prompt_tokens"].sum() for r in result.replicas)
    cached = sum(r.metrics.request_arrays()["cached_tokens"].sum() for r in result.replicas)
    work = [float(r.metrics.step_arrays()["step_time"].sum()) for r in result.replicas]
    source = "sim, a machine each" if cores is None else f"sim, {cores:g} cores"
    source += f" + {background:g} other threads" if background else ""
    source += f", seed {seed}" if seed else ""
    return {"policy": policy, "source": source,
            "prompt_tokens": float(prompt), "cached_tokens": float(cached),
            "hit_rate": prefix["first_admission_hit_rate"],
            "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
            "requests_per_s": s["throughput"]["requests_per_s"],
            "ttft_p50_s": s["latency"]["ttft_s"]["p50"],
            "ttft_p90_s": s["latency"]["ttft_s"]["p90"],
            "tpot_p50_s": s["latency"]["tpot_s"]["p50"],
            "requests_per_replica": s["routing"]["requests"],
            "busy_s_per_replica": work, "sim_cpu_s": cpu,
            "finished": s["requests"]["finished"]}


def calibrate(model_dir: Path, out: Path, quick: bool) -> Path:
    profile = out / "profile.json"
    cmd = [sys.executable, "-m", "scheduler.cli", "calibrate", "--model", str(model_dir),
           "--clock", "cpu", "--out", str(profile), "--no-progress"]
    subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return profile


def serving_factor(args: argparse.Namespace, model_dir: Path, profile: Path,
                   out: Path) -> dict:
    """How much more CPU a serving replica's steps take than the profile
    prices them at (the calibration times `Engine.step` alone in one
    process; a replica also runs its server, the workload's steps are off
    the grid, and replicas sharing the machine slow each other's steps
    beyond taking turns on the cores: caches, memory bandwidth): the fleet
    (`--replicas`, round robin) on `--serving-runs` held-out workloads (the
    next workload seeds), its replicas' engine and MLX threads' CPU seconds
    over the simulated replicas' busy seconds on the same requests (a
    machine each: the priced work), summed over the runs."""
    runs = []
    for k in range(1, args.serving_runs + 1):
        held_out = argparse.Namespace(**{**vars(args), "workload_seed": args.workload_seed + k})
        real = run_real(held_out, model_dir, "round_robin", out / f"serving-calibration{k}")
        config = sim_config(held_out, real["pool_options"], profile)
        sim = run_sim(held_out, config, served(held_out, config, model_dir), "round_robin",
                      None)
        runs.append({"workload_seed": held_out.workload_seed, "load": real["load"],
                     "steps_cpu_s": sum(sum(t["others"]) for t in real["replica_threads_cpu_s"]),
                     "priced_s": sum(sim["busy_s_per_replica"])})
    factor = sum(r["steps_cpu_s"] for r in runs) / sum(r["priced_s"] for r in runs)
    return {"factor": factor, "runs": runs}


def step_noise(profile: Path) -> float:
    """How much steps of one shape vary on this machine: the median, over
    the calibration's decode points, of the standard deviation of the log
    of their steps' times (a point runs the same rows at the same context
    step after step)."""
    import math
    import statistics

    times: dict[str, list[float]] = {}
    for label, seconds, _ in json.loads(profile.read_text())["steps"]:
        if label.startswith("decode B="):
            times.setdefault(label, []).append(seconds)
    spreads = [statistics.pstdev([math.log(t) for t in ts]) for ts in times.values()
               if len(ts) >= 3]
    if not spreads:
        raise SystemExit(f"fleet_predict.py: {profile} has no decode points to measure "
                         "the step noise on")
    return statistics.median(spreads)


def _simulated_kind(row: dict) -> str | None:
    """Which comparison a simulated row is: with the fitted other work
    ("other threads"), also with the serving factor ("serving"), or
    neither."""
    if row["source"].endswith("(serving)"):
        return "serving"
    return "other threads" if "other threads" in row["source"] else None


def print_rows(rows: list[dict]) -> None:
    print("| policy | run | prompt tokens computed | hit rate | out tok/s | TPOT p50 ms "
          "| TTFT p50 / p90 s | requests per replica | replica CPU / busy s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        spread = " / ".join(f"{n:.0f}" for n in r["requests_per_replica"])
        busy = r.get("cpu_s_per_replica", r.get("busy_s_per_replica"))
        print(f"| {r['policy']} | {r['source']} | "
              f"{r['prompt_tokens'] - r['cached_tokens']:.0f} of {r['prompt_tokens']:.0f} | "
              f"{r['hit_rate'] * 100:.1f} % | {r['output_tokens_per_s']:.1f} | "
              f"{r['tpot_p50_s'] * 1e3:.1f} | {r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} | "
              f"{spread} | {' / '.join(f'{b:.1f}' for b in busy)} |")


def is_real(row: dict) -> bool:
    return row["source"].startswith("real")


def compare(sim: dict, real: dict) -> tuple[float, float, float, bool]:
    """`sim` against `real` (rows, or means of rows): the hit rate's points
    off, throughput and TPOT p50 as ratios sim / real, and whether all three
    are within the tolerance (2 points, 10 %)."""
    points = (sim["hit_rate"] - real["hit_rate"]) * 100
    thr = sim["output_tokens_per_s"] / real["output_tokens_per_s"]
    tpot = sim["tpot_p50_s"] / real["tpot_p50_s"]
    return points, thr, tpot, abs(points) <= 2 and abs(thr - 1) <= 0.1 and abs(tpot - 1) <= 0.1


def print_verdict(rows: list[dict]) -> None:
    print("\n| policy | run | against | hit rate, points off | throughput, sim / real | "
          "TPOT p50, sim / real | within (2 points, 10 %) |")
    print("|---|---|---|---|---|---|---|")
    real = {(r["policy"], r["source"]): r for r in rows if is_real(r)}
    for r in rows:
        base = real.get((r["policy"], r.get("against", "real")))
        if is_real(r) or base is None:
            continue
        points, thr, tpot, ok = compare(r, base)
        print(f"| {r['policy']} | {r['source']} | {base['source']} | {points:+.1f} | "
              f"{thr:.2f} | {tpot:.2f} | {'yes' if ok else 'no'} |")


def print_means(rows: list[dict], policies: list[str], kinds: tuple[str, ...]) -> None:
    """Per policy, the mean of the real runs against the mean of each kind
    of simulated run: the real runs of one setup differ from each other by
    about the tolerance (which replica a session's next turn reaches is a
    race under round robin; the machine's speed moves between runs), so
    their mean is what a prediction can be held to."""
    print("\n| policy | simulated | real runs | hit rate, points off | throughput, sim / real "
          "| TPOT p50, sim / real | within (2 points, 10 %) |")
    print("|---|---|---|---|---|---|---|")

    def mean(group: list[dict]) -> dict:
        keys = ("hit_rate", "output_tokens_per_s", "tpot_p50_s")
        return {key: sum(r[key] for r in group) / len(group) for key in keys}

    for policy in policies:
        real = [r for r in rows if r["policy"] == policy and is_real(r)]
        for kind in kinds:
            sim = [r for r in rows if r["policy"] == policy and not is_real(r)
                   and _simulated_kind(r) == kind]
            if not real or not sim:
                continue
            points, thr, tpot, ok = compare(mean(sim), mean(real))
            print(f"| {policy} | {kind} | {len(real)} | {points:+.1f} | {thr:.2f} | "
                  f"{tpot:.2f} | {'yes' if ok else 'no'} |")


def print_spread(rows: list[dict], policies: list[str], kind: str) -> None:
    """Per policy, the range of the real runs and where the simulated runs
    with the other work (`kind` "other threads") or also with the serving
    factor ("serving") fall in it."""
    keys = (("hit_rate", 100, "hit rate %"), ("output_tokens_per_s", 1, "out tok/s"),
            ("tpot_p50_s", 1e3, "TPOT p50 ms"))
    print(f"\n| policy | figure | real runs: min - max | simulated, {kind} "
          "| inside the real range |")
    print("|---|---|---|---|---|")
    for policy in policies:
        real = [r for r in rows if r["policy"] == policy and is_real(r)]
        sim = [r for r in rows if r["policy"] == policy and not is_real(r)
               and _simulated_kind(r) == kind]
        if len(real) < 2 or not sim:
            continue
        for key, scale, name in keys:
            low = min(r[key] for r in real) * scale
            high = max(r[key] for r in real) * scale
            values = [r[key] * scale for r in sim]
            inside = sum(low <= v <= high for v in values)
            print(f"| {policy} | {name} | {low:.1f} - {high:.1f} | "
                  f"{min(values):.1f} - {max(values):.1f} | {inside} of {len(values)} |")


def print_seeds(args: argparse.Namespace, config, sessions: list, rows: list[dict],
                policies: list[str]) -> None:
    """The simulated fleet under `--seeds` seeds of its routers' random tie
    breaks (each another of SMG's runs), beside the mean fitted other work:
    its spread of requests over replicas, throughput and TPOT."""
    print("\n| policy | seed | requests per replica | out tok/s | TPOT p50 ms |")
    print("|---|---|---|---|---|")
    for policy in policies:
        fitted = [float(r["source"].split(" + ")[1].split()[0]) for r in rows
                  if r["policy"] == policy and _simulated_kind(r) == "other threads"]
        background = round(sum(fitted) / len(fitted), 2) if fitted else 0.0
        for seed in range(args.seeds):
            r = run_sim(args, config, sessions, policy, args.cores, background, seed)
            spread = " / ".join(f"{n:.0f}" for n in r["requests_per_replica"])
            print(f"| {policy} | {seed} (+ {background:g} threads) | {spread} | "
                  f"{r['output_tokens_per_s']:.1f} | {r['tpot_p50_s'] * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="round_robin,cache_aware")
    add_fleet_options(parser)
    parser.add_argument("--cores", type=float, default=float(os.cpu_count() or 1),
                        help="cores the simulated replicas share (default this machine's)")
    parser.add_argument("--blas-threads", default="1",
                        help="OPENBLAS_NUM_THREADS of the replicas and the calibration")
    parser.add_argument("--profile", help="a cost profile of this model (default: calibrate "
                        "one first, --clock cpu)")
    parser.add_argument("--quick-calibration", action="store_true")
    parser.add_argument("--serving", action="store_true",
                        help="also simulate with every cost times the serving factor (the "
                        "replicas' step CPU over the profile's price, measured on the same "
                        "fleet under round robin on held-out workloads before the runs) and "
                        "each step's time jittered by the calibration's step noise")
    parser.add_argument("--serving-runs", type=int, default=2,
                        help="held-out fleet runs the serving factor is measured on")
    parser.add_argument("--serving-factor", type=float, metavar="F",
                        help="with --sim-only: the serving factor of the earlier run")
    parser.add_argument("--prefill-batch", type=int,
                        help="the replicas' --prefill-batch (default: blockmgr serve's)")
    parser.add_argument("--sim-only", metavar="SUMMARY",
                        help="simulate against the real rows of an earlier run's summary.json")
    parser.add_argument("--out", default="fleet-predict", help="folder for reports and logs")
    parser.add_argument("--seeds", type=int, default=0,
                        help="also simulate this many seeds of the routers' random ties")
    parser.add_argument("--repeat", type=int, default=1,
                        help="real runs per policy (a fresh fleet each; SMG's cache-aware "
                        "spread differs from run to run)")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = args.blas_threads

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        if args.sim_only:
            rows = [r for r in json.loads(Path(args.sim_only).read_text())
                    if is_real(r) and r["policy"] in policies]
        else:
            profile = Path(args.profile) if args.profile else \
                calibrate(model_dir, out, args.quick_calibration)
            if args.serving:
                serving = serving_factor(args, model_dir, profile, out)
                (out / "serving.json").write_text(json.dumps(serving, indent=1))
                args.serving_factor = serving["factor"]
            rows = []
            for p in policies:
                for run in range(args.repeat):
                    rows.append(run_real(args, model_dir, p, out / p / f"run{run + 1}", run))
                    (out / "real.json").write_text(json.dumps(rows, indent=1))
        profile = Path(args.profile) if args.profile else out / "profile.json"
        config = sim_config(args, rows[0]["pool_options"], profile)
        sessions = served(args, config, model_dir)
        serving_config, jitter = None, 0.0
        if args.serving_factor is not None:
            serving_config = replace(config, cost=config.cost.scaled(args.serving_factor))
            jitter = round(step_noise(profile), 3)
    sent = sum(len(s.tokens) for session in sessions for s in session)
    for real in rows:
        if real["prompt_tokens"] != sent:
            print(f"warning: the replicas counted {real['prompt_tokens']:.0f} prompt tokens "
                  f"({real['policy']}), the simulated requests hold {sent}", file=sys.stderr)
    for real in list(rows):
        seed = int(real["source"].rsplit(" ", 1)[1]) - 1 if "run" in real["source"] else 0
        cores: tuple[float | None, ...] = (None, args.cores) if real["source"] == "real" else ()
        free = real.get("free_cores")
        for c in cores + ((round(free, 2),) if free else ()):
            rows.append({**run_sim(args, config, sessions, real["policy"], c),
                         "against": real["source"]})
        if free:
            background = fit_background(args, config, sessions, real["policy"],
                                        args.cores - free)
            rows.append({**run_sim(args, config, sessions, real["policy"], args.cores,
                                   background, seed), "against": real["source"]})
        if free and serving_config is not None:
            background = fit_background(args, serving_config, sessions, real["policy"],
                                        args.cores - free, jitter, seed)
            row = run_sim(args, serving_config, sessions, real["policy"], args.cores,
                          background, seed, jitter)
            row["source"] += f", steps x {args.serving_factor:.3f} jittered {jitter:g} (serving)"
            rows.append({**row, "against": real["source"]})
    rows.sort(key=lambda r: (policies.index(r["policy"]), not is_real(r)))
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}, "
          f"OPENBLAS_NUM_THREADS={args.blas_threads}; profile {profile}")
    print(f"{args.replicas} replicas, {args.requests} requests, {args.concurrency} clients, "
          f"multiturn {args.turns} turns, system {args.system_len} / user {args.user_len} / "
          f"output {args.output_len} tokens, {args.num_system_prompts} system prompts; "
          f"pool: {' '.join(rows[0]['pool_options'])}")
    for r in rows:
        if is_real(r):
            print(f"{r['policy']} ({r['source']}): "
                  f"load average {r['load'][0]:.2f} -> {r['load'][1]:.2f}, "
                  f"wall {r['wall_s']:.1f} s, gateway CPU {r['gateway_cpu_s']:.1f} s, "
                  f"client CPU {r['client_cpu_s']:.1f} s, other jobs {r['others_cpu_s']:.1f} "
                  f"CPU s, steal {r['steal_s']:.1f} s: {r['free_cores']:.2f} cores left for "
                  f"the replicas")
            print(f"  each replica's threads, CPU s (main: the event loop): "
                  f"{r['replica_threads_cpu_s']}")
            if r.get("smg_branches"):
                print(f"  SMG's cache-aware decisions by branch: {r['smg_branches']}")
    print_rows(rows)
    print_verdict(rows)
    print_spread(rows, policies, "other threads")
    if serving_config is not None:
        print(f"\nserving factor {args.serving_factor:.3f} (a serving replica's step CPU "
              "over the profile's price, the fleet on held-out workloads); step jitter "
              f"{jitter:g} (the calibration's repeated decode steps)")
        print_spread(rows, policies, "serving")
    print_means(rows, policies, ("other threads", "serving"))
    if args.seeds:
        print_seeds(args, config, sessions, rows, policies)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
