"""The `blockmgr` command line: end to end on tiny workloads, and bad options."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from scheduler import cli
from scheduler.simulator import plots
from tests.summaries import deterministic

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

TINY = ["simulate", "-n", "40", "--num-blocks", "512", "--max-context", "2048",
        "--rate", "2", "--no-progress"]


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_end_to_end_writes_the_report(tmp_path, capsys):
    out_dir = tmp_path / "rep"
    code, out, err = run(TINY + ["--check", "8", "--out", str(out_dir)], capsys)
    assert code == 0, err
    report = json.loads((out_dir / "report.json").read_text())
    assert report["summary"]["requests"]["finished"] == 40
    assert report["summary"]["checks"]["leaks"] == "ok"
    assert report["config"]["workload"]["num_requests"] == 40
    assert report["config"]["check_every"] == 8
    md = (out_dir / "report.md").read_text()
    names = ("page_usage.png", "queues.png", "prefix_hit_rate.png", "preemptions.png",
             "latency.png")
    if HAVE_MPL:
        for name in names:
            assert (out_dir / name).stat().st_size > 1000
            assert f"({name})" in md
    else:
        assert "matplotlib is not installed" in err
    assert "prefix hit rate" in out and "report.md" in out
    assert len(report["timeline"]["steps"]["time"]) <= 400


def test_json_summary_matches_report_and_config_reruns(tmp_path, capsys):
    first = tmp_path / "a"
    code, out, _ = run(TINY + ["--workload", "chat=2,multiturn=1", "--json", "--no-plots",
                               "--out", str(first)], capsys)
    assert code == 0
    printed = json.loads(out)
    report = json.loads((first / "report.json").read_text())
    assert deterministic(printed) == deterministic(report["summary"])
    assert report["config"]["workload"]["mix"] == {"chat": 2.0, "multiturn": 1.0}
    code, out, _ = run(["simulate", "--config", str(first / "report.json"), "--json",
                        "--no-plots", "--no-progress", "--out", str(tmp_path / "b")], capsys)
    assert code == 0
    assert deterministic(json.loads(out)) == deterministic(printed)


def test_write_trace_then_replay_gives_the_same_summary(tmp_path, capsys):
    trace = tmp_path / "w.jsonl"
    code, out, _ = run(TINY + ["--write-trace", str(trace), "--json", "--no-plots",
                               "--out", str(tmp_path / "a")], capsys)
    assert code == 0
    direct = json.loads(out)
    code, out, _ = run(TINY + ["--trace", str(trace), "--json", "--no-plots",
                               "--out", str(tmp_path / "b")], capsys)
    assert code == 0
    replayed = json.loads(out)
    assert replayed["prefix_cache"].pop("infinite_cache_hit_rate") > 0  # trace runs only
    assert deterministic(replayed) == deterministic(direct)


def test_sweep_writes_one_table_and_plot(tmp_path, capsys):
    code, out, err = run(TINY + ["--sweep", "enable_prefix_cache=true,false", "--jobs", "2",
                                 "-n", "30", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["params"] for p in data["points"]] == [{"enable_prefix_cache": True},
                                                     {"enable_prefix_cache": False}]
    assert "| enable_prefix_cache |" in (tmp_path / "sweep.md").read_text()
    if HAVE_MPL:
        assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert "hit %" in out


def test_missing_matplotlib_degrades_with_a_message(tmp_path, capsys, monkeypatch):
    def unavailable():
        raise plots.PlottingUnavailable("plots skipped: matplotlib is not installed")

    monkeypatch.setattr(plots, "pyplot", unavailable)
    code, _, err = run(TINY + ["--out", str(tmp_path)], capsys)
    assert code == 0
    assert "matplotlib is not installed" in err
    assert (tmp_path / "report.json").exists()
    assert "matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-blocks", "0"], "--num-blocks: must be >= 1"),
        (["--num-blocks", "many"], "expected an integer"),
        (["--workload", "chess"], "unknown workload 'chess'"),
        (["--workload", "chat=-1"], "weight must be >= 0"),
        (["--output-len", "zipf:3"], "unknown length kind"),
        (["--rate", "-1"], "must be a finite number > 0"),
        (["--arrival", "burst"], "invalid choice"),
        (["--cost", "warp=1"], "expected key=seconds"),
        (["--trace", "/nonexistent/trace.jsonl"], "trace file not found"),
        (["--sweep", "bogus=1,2"], "cannot sweep 'bogus'"),
        (["--jobs", "2"], "--jobs only applies to --sweep"),
        (["--max-context", "100000"], "does not fit the pool"),
        (["--watermark", "1.5"], "watermark must be < 1.0, got 1.5"),
        (["--config", "/nonexistent.json"], "cannot read config"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_options_exit_2_with_one_line(extra, message, capsys, tmp_path):
    code, out, err = run(TINY + ["--out", str(tmp_path)] + extra, capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blockmgr simulate: error: ")
    assert message in lines[0]


def test_no_command_prints_help_and_exits_2(capsys):
    code, _, err = run([], capsys)
    assert code == 2 and "simulate" in err


def test_console_entry_runs_as_a_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler.cli"] + TINY + ["-n", "10", "--no-plots", "--json",
                                                          "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests"]["finished"] == 10


def test_a_failed_check_exits_1_with_one_line(tmp_path, capsys, monkeypatch):
    from scheduler.simulator import runner

    def leak(bm, sched):
        raise runner.LeakError("3 pages in use but the trie holds 2")

    monkeypatch.setattr(runner, "check_no_leaks", leak)
    code, out, err = run(TINY + ["--check", "--out", str(tmp_path)], capsys)
    assert code == 1 and out == ""
    assert err.strip() == ("blockmgr simulate: check failed: LeakError: "
                           "3 pages in use but the trie holds 2")


def test_simulate_help_states_the_true_workload_defaults(capsys):
    """The help's defaults are the config's (the workload default is every
    kind, equally weighted, not chat alone)."""
    from scheduler.simulator.workloads import WORKLOAD_KINDS, WorkloadConfig

    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = WorkloadConfig()
    assert defaults.mix == dict.fromkeys(WORKLOAD_KINDS, 1.0)
    assert "default all, equal weights" in text
    assert f"requests in total (default {defaults.num_requests})" in text
    assert f"new sessions per simulated second (default {defaults.rate:g})" in text
    assert f"closed loop: clients (default {defaults.concurrency})" in text
