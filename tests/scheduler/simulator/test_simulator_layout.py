"""Model layouts in the simulator: the store the engine builds, checked runs.

The simulator must drive the very store an engine builds for a model: the
layer groups of a layout equal `PagedCache`'s groups for a tiny mlx-lm model
of that layout, every preset runs with integrity and leak checks, sliding
layouts hit as often as full attention on a shared-prompt workload, and
the CLI takes `--layout` and `--sliding-window`.
"""

from __future__ import annotations

import json

import pytest

from blockmgr import BlockManagerConfig
from cache import layer_specs
from cache.paged_cache import layer_windows
from scheduler import cli
from scheduler.core.scheduler import SchedulerConfig
from scheduler.simulator import SimulationConfig, WorkloadConfig, run_simulation
from scheduler.simulator.layout import LAYOUTS, ModelLayout, layout_named
from tests.tiny_models import built

#: A tiny model -> the layout its layers form (counts of one model, window).
MODEL_LAYOUTS = {
    "llama": ModelLayout(full=2),
    "gemma3": ModelLayout(full=2, sliding=2, window=16),
    "cohere2": ModelLayout(full=1, sliding=3, window=20),
    "lfm2": ModelLayout(full=1, recurrent=3),
    "recurrent_gemma": ModelLayout(full=0, sliding=1, recurrent=2, window=16),
}


@pytest.mark.parametrize("name", sorted(MODEL_LAYOUTS))
def test_a_layout_has_the_groups_the_engine_builds(name):
    assert MODEL_LAYOUTS[name].windows == layer_windows(layer_specs(built(name)))


def config(layout: ModelLayout, num_slots: int = 0, **workload) -> SimulationConfig:
    wl = dict(mix={"chat": 1.0}, num_requests=150, rate=4.0, seed=5, max_context=2048)
    wl.update(workload)
    return SimulationConfig(
        workload=WorkloadConfig(**wl),
        block_manager=BlockManagerConfig(num_blocks=400, block_size=16, num_slots=num_slots),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=24),
        layout=layout,
        check_every=8,
    )


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_preset_runs_with_checks_and_leaks_nothing(name):
    layout = layout_named(name, 256 if LAYOUTS[name].sliding else None)
    summary = run_simulation(config(layout, num_slots=48 if layout.recurrent else 0)).summary
    assert summary["checks"]["leaks"] == "ok"
    assert summary["requests"]["finished"] == summary["requests"]["submitted"] == 150
    assert summary["prefix_cache"]["hit_rate"] > 0.3  # chat: a shared system prompt


def test_a_sliding_layout_reuses_the_prefixes_full_attention_reuses():
    """Shared system prompts and conversation turns hit in a gemma3-like
    store about as much as with full attention (the first sibling after a
    prompt with no checkpoint at the shared point misses)."""
    full = run_simulation(config(LAYOUTS["full"])).summary["prefix_cache"]["hit_rate"]
    gemma3 = run_simulation(config(layout_named("gemma3", 128))).summary
    assert gemma3["prefix_cache"]["hit_rate"] >= 0.9 * full


def test_layout_settings_are_validated():
    for bad in (dict(full=0), dict(full=0, sliding=1), dict(full=1, window=8),
                dict(full=-1), dict(full=1, sliding=1, window=0), dict(full=True)):
        with pytest.raises(ValueError):
            ModelLayout(**bad)
    with pytest.raises(ValueError):
        layout_named("full", 64)  # no sliding layer to take the window
    with pytest.raises(ValueError):
        config(LAYOUTS["qwen3_next"], num_slots=0)  # recurrent layers need slots


def test_the_cli_takes_a_layout_and_a_window(tmp_path, capsys):
    code = cli.main(["simulate", "-n", "40", "--layout", "gemma3", "--sliding-window", "64",
                     "--check", "--no-plots", "--no-progress", "--json",
                     "--out", str(tmp_path / "r")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["checks"]["leaks"] == "ok"
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["config"]["layout"] == {"full": 1, "sliding": 5, "recurrent": 0, "window": 64}
    assert cli.main(["simulate", "-n", "20", "--sliding-window", "64", "--no-plots",
                     "--no-progress", "--json", "--out", str(tmp_path / "s")]) == 0
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert report["config"]["layout"] == {"full": 0, "sliding": 1, "recurrent": 0, "window": 64}
