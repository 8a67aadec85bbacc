"""Every config is frozen and refuses a bad value on construction with the
project's typed errors (`InvalidArgument` for a value out of range or not
among the choices, `WrongArgumentType` for a value of the wrong kind),
naming the setting; a good value of each kind is accepted. One table for
all of them: the configs share one set of checks (`blockmgr.validation`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from blockmgr import BlockManagerConfig, GroupedStoreConfig
from blockmgr.errors import InvalidArgument, WrongArgumentType
from scheduler import SchedulerConfig
from scheduler.engine.config import CacheConfig, EngineConfig
from scheduler.simulator.calibrate import CalibrationGrid
from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.cost_model import CostModel
from scheduler.simulator.fleet import FleetSpec
from scheduler.simulator.kv_memory import KVMemory, KVShape
from scheduler.simulator.layout import ModelLayout
from scheduler.simulator.routers import RouterSettings
from scheduler.simulator.workloads import WorkloadConfig

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8)

#: Each config's builder from keywords, with what it needs besides them.
CONFIGS = {
    "BlockManagerConfig": lambda **kw: BlockManagerConfig(**{"num_blocks": 8, "block_size": 4,
                                                              **kw}),
    "GroupedStoreConfig": lambda **kw: GroupedStoreConfig(**{"num_blocks": 8, "block_size": 4,
                                                              "windows": (None, 8), **kw}),
    "SchedulerConfig": lambda **kw: SchedulerConfig(**kw),
    "CacheConfig": lambda **kw: CacheConfig(**kw),
    "EngineConfig": lambda **kw: EngineConfig(**kw),
    "SimulationConfig": lambda **kw: SimulationConfig(**kw),
    "WorkloadConfig": lambda **kw: WorkloadConfig(**kw),
    "KVShape": lambda **kw: KVShape(**{"num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                                       **kw}),
    "KVMemory": lambda **kw: KVMemory(**{"budget": 1 << 20, "shape": SHAPE, **kw}),
    "ModelLayout": lambda **kw: ModelLayout(**kw),
    "CostModel": lambda **kw: CostModel(**kw),
    "FleetSpec": lambda **kw: FleetSpec(**kw),
    "RouterSettings": lambda **kw: RouterSettings(**{"num_replicas": 2, "pool_pages": 64, **kw}),
    "CalibrationGrid": lambda **kw: CalibrationGrid(**kw),
}

#: (config, keywords, error, what the message says)
BAD = [
    ("BlockManagerConfig", {"num_blocks": 0}, InvalidArgument, "num_blocks must be >= 1, got 0"),
    ("BlockManagerConfig", {"block_size": 2.0}, WrongArgumentType, "block_size must be an int"),
    ("BlockManagerConfig", {"num_slots": np.int64(2)}, WrongArgumentType,
     "num_slots must be an int"),
    ("BlockManagerConfig", {"enable_prefix_cache": 1}, WrongArgumentType,
     "enable_prefix_cache must be a bool, got 1"),
    ("BlockManagerConfig", {"watermark": 1.0}, InvalidArgument, "watermark must be < 1.0"),
    ("BlockManagerConfig", {"watermark": -0.1}, InvalidArgument, "watermark must be >= 0.0"),
    ("BlockManagerConfig", {"watermark": "0.1"}, WrongArgumentType, "watermark must be a number"),
    ("BlockManagerConfig", {"num_host_slots": 2}, InvalidArgument,
     "num_host_slots needs num_slots > 0"),
    ("GroupedStoreConfig", {"windows": (None, 0)}, InvalidArgument,
     "a sliding window must be >= 1"),
    ("SchedulerConfig", {"max_num_seqs": 0}, InvalidArgument, "max_num_seqs must be >= 1"),
    ("SchedulerConfig", {"max_num_batched_tokens": True}, WrongArgumentType,
     "max_num_batched_tokens must be an int"),
    ("SchedulerConfig", {"policy": "lifo"}, InvalidArgument,
     "policy must be one of 'fcfs', 'priority', 'lpm', got 'lifo'"),
    ("SchedulerConfig", {"preemption": "drop"}, InvalidArgument,
     "preemption must be one of 'recompute', 'swap', got 'drop'"),
    ("SchedulerConfig", {"max_model_len": 0}, InvalidArgument, "max_model_len must be >= 1"),
    ("SchedulerConfig", {"checkpoint_prefill": "yes"}, WrongArgumentType,
     "checkpoint_prefill must be a bool"),
    ("CacheConfig", {"watermark": 1.5}, InvalidArgument, "watermark must be < 1.0"),
    ("CacheConfig", {"enable_prefix_cache": None}, WrongArgumentType,
     "enable_prefix_cache must be a bool"),
    ("EngineConfig", {"batch_probe": 0}, WrongArgumentType, "batch_probe must be a bool"),
    ("EngineConfig", {"prefill_batch": 0}, InvalidArgument, "prefill_batch must be >= 1"),
    ("SimulationConfig", {"vocab_size": 1}, InvalidArgument, "vocab_size must be >= 2"),
    ("SimulationConfig", {"time_scale": 0}, InvalidArgument, "time_scale must be > 0.0"),
    ("SimulationConfig", {"time_scale": float("inf")}, InvalidArgument,
     "time_scale must be finite"),
    ("SimulationConfig", {"trace": 3}, WrongArgumentType, "trace must be a path"),
    ("SimulationConfig", {"scheduler": {}}, WrongArgumentType,
     "scheduler must be a SchedulerConfig"),
    ("WorkloadConfig", {"arrival": "burst"}, InvalidArgument,
     "arrival must be one of 'poisson', 'closed', got 'burst'"),
    ("WorkloadConfig", {"mix": {"chess": 1.0}}, InvalidArgument, "workload must be one of"),
    ("WorkloadConfig", {"mix": {"chat": -1.0}}, InvalidArgument,
     "workload weight for chat must be >= 0.0"),
    ("WorkloadConfig", {"rate": 0.0}, InvalidArgument, "rate must be > 0.0"),
    ("WorkloadConfig", {"seed": -1}, InvalidArgument, "seed must be >= 0"),
    ("WorkloadConfig", {"max_context": 8}, InvalidArgument, "max_context must be >= 16"),
    ("WorkloadConfig", {"n": 1.5}, WrongArgumentType, "n must be an int"),
    ("KVShape", {"dtype": "int8"}, InvalidArgument, "kv shape dtype must be one of"),
    ("KVShape", {"head_dim": 0}, InvalidArgument, "kv shape head_dim must be >= 1"),
    ("KVMemory", {"budget": 0}, InvalidArgument, "kv memory budget must be >= 1"),
    ("KVMemory", {"shape": None}, WrongArgumentType, "kv memory needs a KVShape"),
    ("ModelLayout", {"full": -1}, InvalidArgument, "layout.full must be >= 0"),
    ("ModelLayout", {"sliding": 1, "window": 0}, InvalidArgument, "layout.window must be >= 1"),
    ("CostModel", {"decode_per_token": float("nan")}, InvalidArgument,
     "cost decode_per_token must be finite"),
    ("CostModel", {"step_overhead": -1.0}, InvalidArgument, "cost step_overhead must be >= 0.0"),
    ("FleetSpec", {"router": "random"}, InvalidArgument, "unknown router 'random'"),
    ("FleetSpec", {"cores": 0.0}, InvalidArgument, "cores must be > 0.0"),
    ("RouterSettings", {"page_size": 0}, InvalidArgument, "page_size must be >= 1"),
    ("RouterSettings", {"cache_threshold": 1.5}, InvalidArgument,
     "cache_threshold must be <= 1"),
    ("RouterSettings", {"balance_rel_threshold": 0.5}, InvalidArgument,
     "balance_rel_threshold must be >= 1.0"),
    ("CalibrationGrid", {"repeats": 0}, InvalidArgument, "repeats must be >= 1"),
    ("CalibrationGrid", {"decode_batches": (4, 0)}, InvalidArgument,
     "each of decode_batches must be >= 1"),
]


@pytest.mark.parametrize(("name", "kwargs", "error", "message"), BAD,
                         ids=[f"{name}-{next(iter(kw))}" for name, kw, _, _ in BAD])
def test_a_bad_setting_is_refused_with_a_typed_error_naming_it(name, kwargs, error, message):
    with pytest.raises(error) as raised:
        CONFIGS[name](**kwargs)
    assert message in str(raised.value)
    assert type(raised.value) is error  # not a plain ValueError or TypeError


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_is_frozen(name):
    config = CONFIGS[name]()
    field = dataclasses.fields(config)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field.name, getattr(config, field.name))


def test_a_changed_setting_is_a_new_config_checked_again():
    config = SchedulerConfig()
    assert dataclasses.replace(config, max_num_seqs=4).max_num_seqs == 4
    assert config.max_num_seqs == 256
    with pytest.raises(InvalidArgument, match="max_num_seqs must be >= 1"):
        dataclasses.replace(config, max_num_seqs=0)


def test_good_values_of_each_kind_are_accepted():
    assert BlockManagerConfig(num_blocks=8, block_size=4, watermark=0).watermark == 0
    assert WorkloadConfig(rate=np.float64(2.5), mix={"chat": np.float32(1.0)}).rate == 2.5
    assert SimulationConfig(time_scale=1).time_scale == 1
    assert CostModel(step_overhead=np.float64(0.0)).step_overhead == 0.0
