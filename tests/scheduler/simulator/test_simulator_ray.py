"""Sweeps on a Ray cluster: a local Ray instance gives the same rows as
local processes."""

from __future__ import annotations

import pytest

from scheduler.cli import main
from scheduler.simulator.sweep import grid_points, run_sweep
from tests.scheduler.simulator.test_simulator import small_config
from tests.summaries import deterministic

ray = pytest.importorskip("ray", reason="Ray is the optional 'ray' extra (pip install 'mlx-blockmgr[ray]')")


def test_a_sweep_on_local_ray_matches_local_processes(tmp_path, capsys):
    points = grid_points(small_config(num_requests=30),
                         {"enable_prefix_cache": [True, False], "block_size": [16, 32]}, None)
    on_ray = run_sweep(points, jobs=2, ray_address="local")
    local = run_sweep(points, jobs=1)
    assert [r["params"] for r in on_ray] == [r["params"] for r in local]
    assert [deterministic(r["summary"]) for r in on_ray] == [deterministic(r["summary"]) for r in local]
    assert not ray.is_initialized()  # a cluster started for the sweep is shut down
    assert main(["simulate", "-n", "20", "--sweep", "enable_prefix_cache=true,false", "--ray", "local",
                 "--no-plots", "--no-progress", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "sweep.json").is_file()
    capsys.readouterr()
    assert main(["simulate", "-n", "20", "--ray", "local", "--out", str(tmp_path)]) == 2
    assert "--ray only applies to --sweep" in capsys.readouterr().err
