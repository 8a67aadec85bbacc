"""Fixtures shared by the whole suite.

Shared helpers that are plain functions live in modules beside this file and are
imported by name: `tests.reference` (mlx-lm's greedy decode, the reference for
greedy outputs), `tests.ports` (free loopback ports), `tests.tiny_models`,
`tests.quant_models` and `tests.arch_models` (tiny random-weight models),
`tests.serve_model` (a tiny model directory with a tokenizer), `tests.shadow`
(shadow storages), `tests.leaks`.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

import cache.paged_attention
from tests.serve_model import build_model_dir, load_tiny

#: The seed every test starts from (see `deterministic_seeds`).
SEED = 0


@pytest.fixture(autouse=True)
def deterministic_seeds():
    """Every test starts from the same global random state (Python's, numpy's
    and MLX's), so a test's unseeded draws do not depend on which tests ran
    before it or on `-k`. Tests that need other draws seed their own."""
    random.seed(SEED)
    np.random.seed(SEED)
    mx.random.seed(SEED)


@pytest.fixture(autouse=True)
def paged_attention_for_every_batch(monkeypatch):
    """Every batch of 2+ rows reads its pages in place, as on a device the
    size rule does not cover: on the CPU the tiny test models' histories are
    all small enough to gather (`cache.paged_attention.GATHER_BELOW_BYTES`),
    and the suite's comparisons against mlx-lm must cover the paged path.
    `tests/cache/test_paged_attention.py` tests the rule itself."""
    monkeypatch.setattr(cache.paged_attention, "GATHER_BELOW_BYTES", {})


@pytest.fixture
def garbage_memory(monkeypatch):
    """`np.empty` hands out all-ones bytes (NaN in any float), as memory
    reused from earlier tests may hold: a read of host memory nothing
    wrote shows as NaN instead of depending on what ran before."""
    empty = np.empty

    def garbage(*args, **kwargs):
        out = empty(*args, **kwargs)
        out.reshape(-1).view(np.uint8)[...] = 0xFF
        return out

    monkeypatch.setattr(np, "empty", garbage)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer) of the tiny random-weight llama of `tests.serve_model`,
    loaded by mlx-lm from a directory written for this module."""
    return load_tiny(build_model_dir(tmp_path_factory.mktemp("tiny")))
