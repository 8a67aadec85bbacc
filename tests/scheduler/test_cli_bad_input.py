"""The CLI under bad options, configs and traces: one line on stderr, exit 2,
never a traceback (run as a real process, so nothing escapes unseen)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scheduler import cli
from tests.scheduler.test_cli import TINY, run

TRACES = {
    "absurd prompt": {"arrival": 0, "prefix_ids": [1], "prompt_len": 10**12, "output_len": 2},
    "absurd output": {"arrival": 0, "prompt": [[1, 5]], "output_len": 10**12},
    "zero output": {"arrival": 0, "prompt": [[1, 5]], "output_len": 0},
    "negative arrival": {"arrival": -5, "prompt_tokens": [1, 2], "output_len": 2},
    "prompt not a list": {"arrival": 0, "prompt": 5, "output_len": 2},
    "bad token": {"arrival": 0, "prompt_tokens": [1, -2], "output_len": 2},
    "n zero": {"arrival": 0, "prompt": [[1, 5]], "output_len": 2, "n": 0},
    "unknown after": {"arrival": 0, "prompt_tokens": [1], "output_len": 2, "after": "zz"},
    "bad namespace": {"arrival": 0, "prompt_tokens": [1], "output_len": 2, "namespace": [1]},
}
CONFIGS = {
    "workload a list": {"workload": [1, 2]},
    "workload a string": {"workload": "chat"},
    "block_manager a number": {"block_manager": 5},
    "scheduler null": {"scheduler": None},
    "cost a list": {"cost": []},
    "scheduler partial and bad": {"scheduler": {"policy": 3}},
    "num_blocks float": {"block_manager": {"num_blocks": 1e12}},
    "num_host_blocks absurd": {"block_manager": {"num_host_blocks": 10**11}},
    "not an object": [1, 2],
    "layout a list": {"layout": [1, 5]},
    "layout with an unknown key": {"layout": {"full": 1, "moe": 2}},
    "layout without layers": {"layout": {"full": 0}},
    "layout window without sliding layers": {"layout": {"full": 1, "window": 64}},
    "window in the block manager": {"block_manager": {"sliding_window": 64}},
}
LAYOUT_OPTIONS = {
    "a window for a layout without sliding layers": (["--layout", "qwen3_next",
                                                      "--sliding-window", "64"], "no sliding"),
    "a recurrent layout with one slot": (["--layout", "qwen3_next", "--num-slots", "1"],
                                         "num_slots"),
    "an unknown layout": (["--layout", "nope"], "invalid choice"),
}


@pytest.mark.parametrize("label", sorted(LAYOUT_OPTIONS))
def test_bad_layout_options_exit_2_with_one_line(label, tmp_path):
    argv, message = LAYOUT_OPTIONS[label]
    one_line_exit_2(TINY + argv, tmp_path, message)


def one_line_exit_2(argv, tmp_path, message=""):
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *argv, "--out", str(tmp_path / "rep"),
         "--no-plots"],
        capture_output=True, text=True, timeout=120,
    )
    lines = [line for line in proc.stderr.strip().splitlines()
             if not line.startswith("blockmgr: warning: ")]  # one line each, before the error
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("blockmgr simulate: error: ")
    assert message in lines[0]


@pytest.mark.parametrize("label", sorted(TRACES))
def test_bad_trace_exits_2_with_one_line(label, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(TRACES[label]) + "\n")
    message = "a simulated request may have" if label.startswith("absurd") else ""
    one_line_exit_2(TINY + ["--trace", str(path)], tmp_path, message)


def test_undecodable_trace_exits_2_with_one_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    one_line_exit_2(TINY + ["--trace", str(path)], tmp_path, str(path))


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_bad_config_exits_2_with_one_line(label, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[label]))
    one_line_exit_2(["simulate", "-n", "5", "--no-progress", "--config", str(path)], tmp_path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hybrid", "--preemption", "swap", "--num-host-slots", "0"], "--num-host-slots"),
        (["--num-host-slots", "2"], "num_host_slots needs num_slots"),
        (["--num-host-slots", "-1"], "must be >= 0"),
        (["--num-host-slots", "x"], "expected an integer"),
        (["--num-blocks", "100000000000", "--max-context", "1000"], "a simulated pool may have"),
        (["--sweep", "num_blocks=100000000000"], "a simulated pool may have"),
    ],
)
def test_host_slot_options(extra, message, capsys, tmp_path):
    code, out, err = run(TINY + ["--out", str(tmp_path)] + extra, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_hybrid_swap_with_host_blocks_gets_host_slots():
    """The old failure: host blocks given, host slots silently 0, never a swap."""
    parser = cli.build_parser()
    args = parser.parse_args(["simulate", "--hybrid", "--preemption", "swap",
                              "--num-host-blocks", "64", "--num-slots", "6"])
    assert cli.build_config(args).block_manager.num_host_slots == 6
    args = parser.parse_args(["simulate", "--hybrid", "--preemption", "swap",
                              "--num-host-blocks", "64", "--num-slots", "6",
                              "--num-host-slots", "3"])
    assert cli.build_config(args).block_manager.num_host_slots == 3
