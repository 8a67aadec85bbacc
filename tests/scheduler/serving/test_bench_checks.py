"""`blockmgr bench`'s checks of its own run: offered vs served rate (a
saturation warning) and a cache warm before the run (a rerun with the same
seed), against numbers worked out by hand and a real server; the `bench`
extra does not pull Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scheduler.serving.bench_checks import SATURATION_RATIO, load_section, load_warnings
from scheduler.serving.loadgen import Outcome
from scheduler.simulator.workloads import RequestSpec

ROOT = Path(__file__).resolve().parents[3]


def _outcome(arrival, sent, first_token, cached=None, rid="r"):
    spec = RequestSpec(rid, ((1, 8),), 4, 0, arrival=arrival)
    usage = None if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
    return Outcome(spec, sent, first_token=first_token, finish=first_token + 1, usage=usage)


def test_a_server_that_keeps_up_serves_the_offered_rate():
    # 4 heads at 0.5, 1, 1.5, 2 s (x 2 time scale: 1 .. 4 s), each answered 50 ms after it came
    outcomes = [_outcome(a, 2 * a, 2 * a + 0.05, cached=0, rid=str(a))
                for a in (0.5, 1, 1.5, 2)]
    load = load_section(outcomes, time_scale=2.0)
    assert load["offered_sessions_per_s"] == pytest.approx(4 / 4.0)
    assert load["served_sessions_per_s"] == pytest.approx(4 / 4.05)
    assert not load["saturated"] and load_warnings(load) == []
    assert load["first_request_cached_tokens"] == 0


def test_a_server_that_falls_behind_is_flagged():
    # the README's run: 2 offered sessions/s, the last head's first token at twice its arrival
    outcomes = [_outcome(a / 2, a / 2, a / 2 + 0.1) for a in range(1, 20)]
    outcomes.append(_outcome(10.0, 10.0, 19.2, rid="last"))
    load = load_section(outcomes, time_scale=1.0)
    assert load["offered_sessions_per_s"] == pytest.approx(20 / 10.0)
    assert load["served_sessions_per_s"] == pytest.approx(20 / 19.2)
    assert load["served_sessions_per_s"] < SATURATION_RATIO * load["offered_sessions_per_s"]
    assert load["saturated"]
    (line,) = load_warnings(load)
    assert "served 1.04 of 2.00 offered sessions/s" in line


def test_closed_loop_runs_have_no_offered_rate_and_a_warm_first_request_warns():
    outcomes = [_outcome(None, 0.0, 0.2, cached=48), _outcome(None, 0.1, 0.3, cached=0)]
    load = load_section(outcomes, time_scale=1.0)
    assert load["offered_sessions_per_s"] is None and not load["saturated"]
    assert load["first_request_cached_tokens"] == 48
    (line,) = load_warnings(load)
    assert "48 cached prompt tokens" in line and "--fresh-cache" in line


def test_the_bench_extra_does_not_pull_ray():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib")
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = [req.split(">")[0].split("=")[0].split("[")[0].strip().lower()
             for req in extras["bench"]]
    assert "ray" not in names and "httpx2" in names
    assert any(req.startswith("ray") for req in extras["ray"])


# ------------------------------------------------------------- a real server

pytest.importorskip("uvicorn")


def test_a_rerun_with_the_same_seed_warns_and_fresh_cache_does_not(tmp_path, capsys):
    from scheduler.cli import main
    from scheduler.serving.async_engine import AsyncEngine
    from scheduler.serving.operator_api import build_serving_app
    from scheduler.serving.serve import load_engine, serve_config
    from tests.scheduler.serving.test_bench import WORKLOAD
    from tests.scheduler.serving.test_server import ServerThread
    from tests.serve_model import build_model_dir

    engine, name = load_engine(build_model_dir(tmp_path / "tiny"),
                               serve_config(num_blocks=512, block_size=8))

    def bench(out, *extra):
        assert main(["bench", "--url", server.url, "--out", str(tmp_path / out), *WORKLOAD,
                     *extra]) == 0
        report = json.loads((tmp_path / out / "report.json").read_text())
        return report["summary"]["load"], capsys.readouterr().err

    with ServerThread(build_serving_app(AsyncEngine(engine), name)) as server:
        first, first_err = bench("first")
        second, second_err = bench("second")
        fresh, fresh_err = bench("fresh", "--fresh-cache")
    assert first["first_request_cached_tokens"] == 0 and "warning" not in first_err
    assert second["first_request_cached_tokens"] > 16  # the whole first prompt but its tail
    assert "prefix cache was warm before this run" in second_err
    assert fresh["first_request_cached_tokens"] == 0 and "warning" not in fresh_err
    assert "WARNING" in (tmp_path / "second" / "report.md").read_text()


def test_an_offered_rate_far_above_the_server_is_flagged(tmp_path, capsys):
    from scheduler.cli import main
    from scheduler.serving.async_engine import AsyncEngine
    from scheduler.serving.operator_api import build_serving_app
    from scheduler.serving.serve import load_engine, serve_config
    from tests.scheduler.serving.test_server import ServerThread
    from tests.serve_model import build_model_dir

    engine, name = load_engine(build_model_dir(tmp_path / "tiny"),
                               serve_config(num_blocks=512, block_size=8))
    workload = ["--workload", "chat", "-n", "12", "--arrival", "poisson", "--seed", "3",
                "--user-len", "fixed:40", "--output-len", "fixed:40", "--turns", "fixed:1",
                "--no-progress", "--no-plots", "--fresh-cache"]
    with ServerThread(build_serving_app(AsyncEngine(engine), name)) as server:
        assert main(["bench", "--url", server.url, "--out", str(tmp_path / "fast"), *workload,
                     "--rate", "1000"]) == 0
        fast = json.loads((tmp_path / "fast" / "report.json").read_text())["summary"]["load"]
        err = capsys.readouterr().err
    assert fast["offered_sessions_per_s"] > 200  # 12 heads within a few ms
    assert fast["saturated"] and "fell behind the offered rate" in err
