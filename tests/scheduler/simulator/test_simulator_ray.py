"""Sweeps on a Ray cluster: a local Ray instance gives the same rows as
local processes."""

from __future__ import annotations

import json

import pytest

from scheduler.cli import main
from scheduler.simulator.sweep import grid_points, run_sweep
from tests.scheduler.simulator.test_simulator import small_config
from tests.summaries import deterministic

ray = pytest.importorskip("ray", reason="Ray is the optional 'ray' extra "
                                       "(pip install 'mlx-blockmgr[ray]')")


def test_a_sweep_on_local_ray_matches_local_processes(tmp_path, capsys):
    points = grid_points(small_config(num_requests=30),
                         {"enable_prefix_cache": [True, False], "block_size": [16, 32]}, None)
    on_ray = run_sweep(points, jobs=2, ray_address="local")
    local = run_sweep(points, jobs=1)
    assert [r["params"] for r in on_ray] == [r["params"] for r in local]
    assert [deterministic(r["summary"]) for r in on_ray] == \
        [deterministic(r["summary"]) for r in local]
    assert not ray.is_initialized()  # a cluster started for the sweep is shut down
    assert main(["simulate", "-n", "20", "--sweep", "enable_prefix_cache=true,false",
                 "--ray", "local", "--no-plots", "--no-progress", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "sweep.json").is_file()
    capsys.readouterr()
    assert main(["simulate", "-n", "20", "--ray", "local", "--out", str(tmp_path)]) == 2
    assert "--ray only applies to --sweep" in capsys.readouterr().err


def test_a_fleet_sweep_on_local_ray_matches_local_processes(tmp_path, capsys):
    """`--sweep` over replicas x routers: the fleets Ray runs give the rows
    local processes give."""
    def sweep(out, *extra):
        code = main(["simulate", "--workload", "chat,multiturn", "-n", "60", "--replicas", "2",
                     "--sweep", "replicas=2,3;router=round_robin,cache_aware", "--no-plots",
                     "--no-progress", "--out", str(tmp_path / out), *extra])
        assert code == 0, capsys.readouterr().err
        return json.loads((tmp_path / out / "sweep.json").read_text())

    on_ray, local = sweep("ray", "--ray", "local"), sweep("local", "--jobs", "1")
    rows, local_rows = on_ray["points"], local["points"]
    assert [r["params"] for r in rows] == [r["params"] for r in local_rows]
    assert {(p["replicas"], p["router"]) for p in (r["params"] for r in rows)} == {
        (2, "round_robin"), (2, "cache_aware"), (3, "round_robin"), (3, "cache_aware")}
    assert [deterministic(r["summary"]) for r in rows] == [
        deterministic(r["summary"]) for r in local_rows]
    assert not ray.is_initialized()
