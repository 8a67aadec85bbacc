"""One conversation's cached prefix exported to a file and imported into
another cache: the logits of a prompt that hits the imported prefix equal,
bit for bit, those of the same prefix never evicted (attention and hybrid
models); another model's file, or a damaged one, is refused with a typed
error and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from blockmgr.errors import InvalidArgument
from cache.prefix_file import CorruptPrefixFile, ForeignPrefixFile
from tests.cache.test_cache_tiers import QUERY, A, evict_a, make, model_of, reference, run


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.mark.parametrize("name", ["llama", "lfm2"])
@pytest.mark.parametrize("tiers", ["device", "host"])
def test_an_imported_prefix_gives_the_never_evicted_logits_bit_for_bit(models, tmp_path,
                                                                       name, tiers):
    model = model_of(models, name)
    expected = reference(model, name)
    options = {"host_cache_size": "1MiB"} if tiers == "host" else {"num_blocks": 64}
    source = make(model, name, **options)
    if tiers == "host":
        evict_a(source, model)  # exported from the host tier: loaded back first
    else:
        run(source, model, "a", A)
    path = tmp_path / "a.prefix"
    assert source.export_prefix(A, path) == len(A)
    source.check_integrity()
    target = make(model, name, num_blocks=64)
    run(target, model, "warm", [7] * 9)  # the pools exist after a first forward
    assert target.import_prefix(path) == len(A)
    target.check_integrity()
    assert target.cached_prefix_length(QUERY) == len(A)
    logits, n = run(target, model, "q", QUERY)
    assert n == len(A)
    np.testing.assert_array_equal(logits, expected)
    target.check_integrity()
    assert target.num_free_blocks + target.store.num_cached_blocks == target.num_usable_blocks


def test_a_foreign_or_damaged_file_is_refused_and_nothing_changes(models, tmp_path):
    llama, sliding = model_of(models, "llama"), model_of(models, "sliding")
    source = make(llama, "llama", num_blocks=64)
    run(source, llama, "a", A)
    path = tmp_path / "a.prefix"
    source.export_prefix(A, path)
    other = make(sliding, "sliding", num_blocks=64)
    run(other, sliding, "warm", [7] * 9)
    before = other.store.debug_state()
    with pytest.raises(ForeignPrefixFile):
        other.import_prefix(path)
    assert other.store.debug_state() == before
    target = make(llama, "llama", num_blocks=64)
    run(target, llama, "warm", [7] * 9)
    before = target.store.debug_state()
    data = path.read_bytes()
    for damaged in (data[:-7], data[:-100] + bytes(100), b"not a prefix file"):
        path.write_bytes(damaged)
        with pytest.raises(CorruptPrefixFile):
            target.import_prefix(path)
        assert target.store.debug_state() == before
    with pytest.raises(InvalidArgument, match="nothing of these tokens is cached"):
        target.export_prefix([99, 98, 97], tmp_path / "none.prefix")
    assert not (tmp_path / "none.prefix").exists()
    target.check_integrity()


def test_an_engine_restarted_empty_imports_a_conversation_and_generates_the_same(tmp_path):
    from scheduler import Engine, SamplingParams
    from tests.tiny_models import built

    model = built("lfm2")
    history = list(range(3, 43))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = Engine(model, num_blocks=32, block_size=8, num_slots=4)
    want = first.generate([history + [5, 6]], params)[0].tokens
    first.generate([history], params)
    assert first.export_prefix(history, tmp_path / "chat.prefix") >= 32
    fresh = Engine(model, num_blocks=32, block_size=8, num_slots=4)
    num = fresh.import_prefix(tmp_path / "chat.prefix")
    out = fresh.generate([history + [5, 6]], params)[0]
    assert out.metrics.num_cached_tokens == num and out.tokens == want
    fresh.check_integrity()
