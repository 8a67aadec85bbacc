"""`load_engine(path, config, budget=...)`: one `EngineConfig` is how a model
directory is loaded; sizing the pool to a memory budget makes a complete
config before the engine is built; the old setting keywords still work, with
one deprecation line."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from blockmgr.errors import InvalidArgument
from scheduler.engine.config import EngineConfig
from scheduler.serving.serve import KVBudget, load_engine, serve_config, touch_pool
from tests.serve_model import build_model_dir

CONTEXT = 100  # the model's max_position_embeddings
BLOCK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("load") / "tiny", context=CONTEXT)


def test_the_engine_runs_the_config_it_is_given(model_dir):
    config = serve_config(num_blocks=64, block_size=BLOCK, max_num_seqs=4)
    engine, name = load_engine(model_dir, config)
    assert name == "tiny"
    assert config.scheduler.max_model_len is None  # the caller's config is not changed
    # the pool holds 512 tokens, the model reads 100: max_model_len is resolved
    resolved = replace(config, scheduler=replace(config.scheduler, max_model_len=CONTEXT))
    assert engine.config == resolved
    assert engine.scheduler.config == resolved.scheduler
    assert (engine.cache.num_blocks, engine.cache.block_size) == (64, BLOCK)
    assert engine.prefill_batch == config.prefill_batch == 8  # serve's default


def test_a_pool_smaller_than_the_context_bounds_max_model_len(model_dir):
    engine, _ = load_engine(model_dir, serve_config(num_blocks=8, block_size=BLOCK))
    assert engine.scheduler.config.max_model_len == 8 * BLOCK


def test_a_budget_sizes_the_pool_to_the_bytes_it_allocates(model_dir):
    budget = 200_000
    config = serve_config(num_blocks=1, block_size=BLOCK, max_num_seqs=4)
    engine, _ = load_engine(model_dir, config, budget=KVBudget(budget))
    touch_pool(engine)  # pools take their memory at the first write
    num_blocks, nbytes = engine.cache.num_blocks, engine.cache.nbytes
    assert num_blocks > 1 and config.cache.num_blocks == 1
    # the pool fits the budget, and one more page would not
    assert nbytes <= budget < nbytes + nbytes // num_blocks


def test_the_old_keywords_warn_once_and_build_the_same_engine(model_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, _ = load_engine(model_dir, num_blocks=64, block_size=BLOCK, max_num_seqs=4)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__  # the line is the caller's
    new, _ = load_engine(model_dir, serve_config(num_blocks=64, block_size=BLOCK,
                                                 max_num_seqs=4))
    assert old.config == new.config


def test_a_config_and_setting_keywords_together_are_refused(model_dir):
    with pytest.raises(InvalidArgument, match="not both"):
        load_engine(model_dir, EngineConfig(), num_blocks=64)


def test_a_max_model_len_beyond_the_context_is_refused_before_loading(model_dir):
    with pytest.raises(InvalidArgument, match="more than the model's context"):
        load_engine(model_dir, serve_config(max_model_len=CONTEXT + 1))
