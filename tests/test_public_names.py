"""The public names of `scheduler` (its `__all__`) all exist: `from scheduler
import *` binds every one, each resolving to the object of the room that
defines it; importing the front door loads no MLX until an engine name is
read."""

from __future__ import annotations

import subprocess
import sys

import scheduler

#: Where each public name is defined (module, attribute): written out, not
#: read from `scheduler`, so a name dropped or moved behind the front door shows.
DEFINED = {
    "AsyncEngine": "scheduler.serving.async_engine",
    "AutoRequestId": "scheduler.engine.engine",
    "CacheConfig": "scheduler.engine.config",
    "DecodeRows": "scheduler.core.records",
    "Engine": "scheduler.engine.engine",
    "EngineConfig": "scheduler.engine.config",
    "EngineStopped": "scheduler.serving.async_engine",
    "GenerationOutput": "scheduler.engine.engine",
    "QueueFull": "scheduler.serving.async_engine",
    "Request": "scheduler.core.request",
    "RequestMetrics": "scheduler.core.request",
    "RequestOutput": "scheduler.core.records",
    "RequestStatus": "scheduler.core.request",
    "RequestTooLarge": "scheduler.core.scheduler",
    "SamplingParams": "scheduler.core.request",
    "ScheduledSeq": "scheduler.core.records",
    "Scheduler": "scheduler.core.scheduler",
    "SchedulerConfig": "scheduler.core.config",
    "SchedulerOutput": "scheduler.core.records",
    "SchedulerStats": "scheduler.core.records",
    "SequenceInfo": "scheduler.core.records",
    "StaleSchedulerOutput": "scheduler.core.scheduler",
}


def test_star_import_binds_every_public_name():
    code = (
        "import importlib, json, sys\n"
        "from scheduler import *\n"
        f"defined = {DEFINED!r}\n"
        "names = dict(globals())\n"
        "missing = [n for n in defined if n not in names]\n"
        "wrong = [n for n, m in defined.items() if n in names\n"
        "         and names[n] is not getattr(importlib.import_module(m), n)]\n"
        "print(json.dumps([missing, wrong]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[], []]"


def test_all_lists_exactly_the_public_names():
    assert sorted(scheduler.__all__) == sorted(DEFINED)


def test_the_front_door_loads_no_mlx_until_an_engine_name_is_read():
    code = (
        "import sys\n"
        "from scheduler import Scheduler, SamplingParams, Request\n"
        "before = [m for m in sys.modules if m.split('.')[0] == 'mlx']\n"
        "from scheduler import Engine\n"
        "after = [m for m in sys.modules if m.split('.')[0] == 'mlx']\n"
        "print(len(before), len(after) > 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"]
