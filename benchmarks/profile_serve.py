"""Where `blockmgr serve` and `mlx_lm.server` spend their steps, under the
load of `compare_serve.py` (same model, traces and `blockmgr bench` runs).

Each server runs as a subprocess of this script (`child` mode) with two
measuring wrappers installed before it starts: the model's `__call__`
records every forward's input shape (rows x tokens) and whether the LM
head of that forward is evaluated (mlx-lm: inside `GenerationBatch._step`;
the engine: a group with a sampled row), and the server's step
(`BatchGenerator._next` / `Engine.step`) records its wall time and the
forwards it ran, one JSON line per step. The wrappers only read; the
servers run their own code.

The summary per (workload, server): generated tokens, steps, forwards and
LM-head forwards per generated token, rows per LM-head forward, prompt
tokens run, the wall time inside steps and between them, and the time of
steps that ran only the decode forward against those that also ran other
forwards.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/profile_serve.py --requests 32 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


# ------------------------------------------------------------------ child

class _Recorder:
    """The forwards of the step that is running, written out per step."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "w", buffering=1)
        self.forwards: list[tuple[int, int, bool]] | None = None
        self.head = False
        self.last_end: float | None = None

    def step(self, run, info):
        """Run one server step, recording its forwards and time."""
        self.forwards = []
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            t1 = time.perf_counter()
            gap = None if self.last_end is None else t0 - self.last_end
            self.last_end = t1
            forwards, self.forwards = self.forwards, None
            if forwards:
                self.file.write(json.dumps({"t": t0, "dt": t1 - t0, "gap": gap,
                                            "forwards": forwards, **info()}) + "\n")


def _wrap_model(recorder: _Recorder) -> None:
    from mlx_lm.models import qwen3

    call = qwen3.Model.__call__

    def recorded(self, inputs, *args, **kwargs):
        if recorder.forwards is not None:
            recorder.forwards.append((int(inputs.shape[0]), int(inputs.shape[1]), recorder.head))
        return call(self, inputs, *args, **kwargs)

    qwen3.Model.__call__ = recorded


def _with_head(recorder: _Recorder, cls, name: str, head) -> None:
    method = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        recorder.head = head(self, *args)
        try:
            return method(self, *args, **kwargs)
        finally:
            recorder.head = False

    setattr(cls, name, wrapped)


def child(kind: str, log: str, argv: list[str]) -> None:
    recorder = _Recorder(log)
    _wrap_model(recorder)
    if kind == "mlx_lm":
        import importlib

        generate = importlib.import_module("mlx_lm.generate")  # (the package exports a function)
        server = importlib.import_module("mlx_lm.server")

        _with_head(recorder, generate.GenerationBatch, "_step", lambda self: True)
        nxt = generate.BatchGenerator._next

        def step(self):
            rows = len(self._generation_batch)
            return recorder.step(lambda: nxt(self), lambda: {"rows_before": rows})

        generate.BatchGenerator._next = step
        sys.argv = ["mlx_lm.server", *argv]
        server.main()
    else:
        from scheduler import cli
        from scheduler.engine import engine

        _with_head(recorder, engine.Engine, "_forward",
                   lambda self, group: any(s.sample for s in group))
        run = engine.Engine.step

        def step(self):
            before = (self.stats.num_decode_tokens, self.stats.num_prefill_tokens,
                      self.stats.num_generated_tokens)

            def info():
                s = self.stats
                return {"decode": s.num_decode_tokens - before[0],
                        "prefill": s.num_prefill_tokens - before[1],
                        "generated": s.num_generated_tokens - before[2]}
            return recorder.step(lambda: run(self), info)

        engine.Engine.step = step
        cli.main(["serve", *argv])


# ----------------------------------------------------------------- parent

def summarize(path: Path, t_start: float, num_generated: int, wall: float) -> dict:
    """The steps recorded after `t_start` (the measured bench run)."""
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [s for s in steps if s["t"] >= t_start]
    forwards = [f for s in steps for f in s["forwards"]]
    heads = [f for f in forwards if f[2]]
    plain = [f for f in forwards if not f[2]]
    decode_only = [s["dt"] for s in steps if _decode_only(s)]
    mixed = [s["dt"] for s in steps if not _decode_only(s)]
    in_steps = sum(s["dt"] for s in steps)
    # The period of a decode step: start to start of two decode-only steps in
    # a row (mlx-lm evaluates a step asynchronously, so its own time is not it).
    periods = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])
               if _decode_only(a) and _decode_only(b)]
    period = statistics.median(periods) if periods else None
    return {
        "generated": num_generated,
        "wall_s": round(wall, 2),
        "steps": len(steps),
        "in_steps_s": round(in_steps, 2),
        "forwards_per_token": round(len(forwards) / num_generated, 3),
        "head_forwards_per_token": round(len(heads) / num_generated, 3),
        "rows_per_head_forward": round(sum(f[0] for f in heads) / max(len(heads), 1), 2),
        "no_head_forwards": len(plain),
        "no_head_tokens": sum(f[0] * f[1] for f in plain),
        "head_forward_tokens_beyond_rows": sum(f[0] * (f[1] - 1) for f in heads),
        "decode_only_steps": len(decode_only),
        "decode_only_step_ms": round(1e3 * statistics.mean(decode_only), 1) if decode_only
        else None,
        "other_steps": len(mixed),
        "other_steps_s": round(sum(mixed), 2),
        "other_step_ms": round(1e3 * statistics.mean(mixed), 1) if mixed else None,
        "decode_period_ms": round(1e3 * period, 1) if period else None,
        # the run's wall time in decode steps; its floor is generated / clients
        "decode_step_equivalents": round(wall / period, 1) if period else None,
    }


def _decode_only(step: dict) -> bool:
    return len(step["forwards"]) == 1 and step["forwards"][0][2]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        kind, log = sys.argv[2], sys.argv[3]
        child(kind, log, sys.argv[4:])
        return
    import compare_serve as cs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=400)
    parser.add_argument("--servers", default="blockmgr,mlx_lm")
    parser.add_argument("--workloads", default="shared,multiturn")
    parser.add_argument("--kv-memory", default="256MiB")
    parser.add_argument("--blockmgr-args", default="",
                        help="more `blockmgr serve` options, space separated")
    parser.add_argument("--out", default="serve-profile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = cs.build_qwen3_dir(Path(tmp) / "qwen3-shape", args.layers)
        traces = cs.write_traces(Path(tmp), args.requests, args.system_words, args.max_tokens)
        (Path(tmp) / "warm").mkdir()
        warmup = cs.write_traces(Path(tmp) / "warm", 2, args.system_words, 4)
        for name in args.workloads.split(","):
            for kind in args.servers.split(","):
                port = cs.free_port()
                log = out / f"{name}-{kind}.steps.jsonl"
                if kind == "blockmgr":
                    argv = ["--model", str(model_dir), "--port", str(port),
                            "--kv-memory", args.kv_memory, "--max-num-seqs", "64",
                            *args.blockmgr_args.split()]
                else:
                    argv = ["--model", str(model_dir), "--port", str(port),
                            "--decode-concurrency", str(args.concurrency),
                            "--prompt-concurrency", str(args.concurrency),
                            "--log-level", "WARNING"]
                proc = subprocess.Popen(
                    [sys.executable, __file__, "child", kind, str(log), *argv], cwd=ROOT,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONPATH": str(ROOT)})
                url = f"http://127.0.0.1:{port}"
                try:
                    cs.wait_up(url, proc)
                    model = model_dir.name if kind == "blockmgr" else str(model_dir)
                    cs.bench(url, model, warmup[name], 1, out / f"warmup-{name}-{kind}")
                    time.sleep(0.5)
                    t_start = time.perf_counter()  # CLOCK_MONOTONIC: shared with the child
                    s = cs.bench(url, model, traces[name], args.concurrency, out / f"{name}-{kind}")
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                summary = summarize(log, t_start, s["requests"]["output_tokens"],
                                    s["throughput"]["seconds"])
                summary["tok_s"] = round(s["throughput"]["output_tokens_per_s"], 2)
                print(name, kind, json.dumps(summary), flush=True)

if __name__ == "__main__":
    main()
