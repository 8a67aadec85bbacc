"""mlx-lm's own `speculative_generate_step` on paged views (`PagedCache.speculative_model`).

Greedy outputs over paged views equal mlx-lm's `generate_step` with the
target alone, for an attention model (also equal, token and draft flag, to
`speculative_generate_step` on mlx-lm's own caches) and hybrid models
(lfm2, qwen3_next; recurrent_gemma adds a sliding window), with the target
itself as draft (agrees always), a draft that agrees part of the time and
a random-weight draft that rarely agrees (every round restores the
checkpoints and replays tokens). After each run both storages pass
`check_integrity` and freeing releases every page and slot. Logits after a
replay equal mlx-lm's; a raising forward leaves the storage as before.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import speculative_generate_step

from blockmgr.errors import InvalidArgument, OutOfBlocks
from cache import PagedCache
from tests.leaks import assert_only_the_cache_holds
from tests.reference import greedy_reference
from tests.scheduler.test_speculative import NOISE, noisy_copy
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built

MAX_TOKENS = 16
NUM_DRAFT = 3
TOL = 1e-4
#: Draft noise (x each weight's std) giving partial agreement, per model.
PARTIAL = {"llama": 1.0, "lfm2": 0.6, "qwen3_next": 0.05, "recurrent_gemma": 0.3}
_drafts: dict = {}


def vocab(name: str) -> int:
    return ATTENTION_VOCAB if name == "llama" else HYBRID_VOCAB


def draft_model(name: str, kind: str):
    """The target itself, or a noisy copy of it (same vocabulary)."""
    if kind == "self":
        return built(name)
    if (name, kind) not in _drafts:
        _drafts[name, kind] = noisy_copy(name, PARTIAL[name] if kind == "partial" else NOISE[kind])
    return _drafts[name, kind]


def paged(model) -> PagedCache:
    return PagedCache.for_model(model, num_blocks=64, block_size=8, num_slots=6)


def prompt_of(name: str, n: int = 19) -> list[int]:
    return [(7 * i + 3) % vocab(name) for i in range(n)]


def speculate_on_views(target, draft, prompt: list[int]):
    """(tokens, from-draft flags, target storage, draft storage)."""
    pc, dc = paged(target), paged(draft)
    pc.allocate("a", prompt)
    dc.allocate("a", prompt)
    t, d = pc.speculative_model(target, ["a"]), dc.speculative_model(draft, ["a"])
    steps = speculative_generate_step(
        mx.array(prompt), t, d, prompt_cache=t.cache + d.cache, num_draft_tokens=NUM_DRAFT,
        max_tokens=MAX_TOKENS, prefill_step_size=8)
    out = [(int(tok), bool(from_draft)) for tok, _, from_draft in steps]
    return [tok for tok, _ in out], [f for _, f in out], pc, dc


def assert_all_released(pc: PagedCache) -> None:
    pc.check_integrity()
    assert_only_the_cache_holds(pc.store)


@pytest.mark.parametrize("kind", ["self", "partial", "disagrees"])
@pytest.mark.parametrize("name", ["llama", "lfm2", "qwen3_next", "recurrent_gemma"])
def test_greedy_speculative_loop_on_views_equals_generate_step(name, kind):
    target, draft = built(name), draft_model(name, kind)
    prompt = prompt_of(name)
    got, from_draft, pc, dc = speculate_on_views(target, draft, prompt)
    assert got == greedy_reference(target, prompt, MAX_TOKENS)
    num_accepted = sum(from_draft)
    if kind == "self":
        assert num_accepted >= MAX_TOKENS * NUM_DRAFT // (NUM_DRAFT + 1) - 1
    elif kind == "partial":
        assert 0 < num_accepted < MAX_TOKENS * NUM_DRAFT // (NUM_DRAFT + 1) - 1
    else:
        assert num_accepted <= MAX_TOKENS // 4
    if name == "llama":  # mlx-lm's own loop accepts attention caches: same tokens and flags
        steps = speculative_generate_step(mx.array(prompt), target, draft,
                                          num_draft_tokens=NUM_DRAFT, max_tokens=MAX_TOKENS)
        assert [(int(t), bool(f)) for t, _, f in steps] == list(zip(got, from_draft))
    for storage in (pc, dc):
        storage.check_integrity()
        storage.free("a")
        assert_all_released(storage)


@pytest.mark.parametrize("kind", ["self", "disagrees"])
def test_attention_models_run_on_plain_views_too(kind):
    """No wrapper needed without recurrent state: `trim` truncates."""
    target, draft = built("llama"), draft_model("llama", kind)
    prompt = prompt_of("llama")
    pc, dc = paged(target), paged(draft)
    pc.allocate("a", prompt)
    dc.allocate("a", prompt)
    steps = speculative_generate_step(
        mx.array(prompt), target, draft, prompt_cache=pc.views(["a"]) + dc.views(["a"]),
        num_draft_tokens=NUM_DRAFT, max_tokens=MAX_TOKENS, prefill_step_size=8)
    got = [(int(t), bool(f)) for t, _, f in steps]
    mlx_lm = speculative_generate_step(mx.array(prompt), target, draft,
                                       num_draft_tokens=NUM_DRAFT, max_tokens=MAX_TOKENS)
    assert got == [(int(t), bool(f)) for t, _, f in mlx_lm]
    assert [t for t, _ in got] == greedy_reference(target, prompt, MAX_TOKENS)
    for storage in (pc, dc):
        storage.free("a")
        assert_all_released(storage)


def test_known_ids_reach_the_prefix_cache():
    target = built("lfm2")
    prompt = prompt_of("lfm2")
    got, _, pc, dc = speculate_on_views(target, draft_model("lfm2", "disagrees"), prompt)
    computed = pc.num_computed("a")
    assert pc.tokens("a")[:computed] == (prompt + got)[:computed]
    pc.free("a")
    assert pc.allocate("b", prompt + got).num_cached_tokens == computed


# --- the calls one by one ------------------------------------------------------


def reference_logits(model, seq: list[int]) -> np.ndarray:
    return np.array(model(mx.array([seq]), cache=model.make_cache())[0])


@pytest.fixture(params=["lfm2", "qwen3_next", "recurrent_gemma"])
def hybrid(request):
    return request.param


def prefilled(name):
    """A storage holding a computed prompt and its SpeculativeModel."""
    model = built(name)
    pc = paged(model)
    prompt = prompt_of(name, 11)
    pc.allocate("a", prompt)
    spec = pc.speculative_model(model, ["a"])
    spec(mx.array([prompt]), cache=spec.cache)
    return model, pc, spec, prompt


def test_trim_restores_the_checkpoint_and_the_next_call_replays(hybrid):
    model, pc, spec, prompt = prefilled(hybrid)
    views = spec.cache
    assert all(v.is_trimmable() for v in views)
    spec(mx.array([[5, 6, 7, 8]]), cache=views)  # verification of 3 drafts
    assert pc.speculation_start("a") == len(prompt)
    assert [v.trim(2) for v in views] == [2] * len(views)  # once per batch
    assert pc.speculation_start("a") is None
    assert pc.num_tokens("a") == len(prompt) + 2 and pc.num_computed("a") == len(prompt)
    assert pc.num_replay("a") == 2
    got = np.array(spec(mx.array([[9, 10]]), cache=views)[0])
    assert got.shape == (2, vocab(hybrid))  # the replayed positions' logits are dropped
    want = reference_logits(model, prompt + [5, 6, 9, 10])[-2:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert pc.num_replay("a") == 0 and pc.num_computed("a") == len(prompt) + 4
    pc.check_integrity()


def test_draft_rounds_of_one_token_calls_roll_back_together(hybrid):
    model, pc, spec, prompt = prefilled(hybrid)
    views = spec.cache
    for tok in (21, 22, 23):  # three one-token forwards extend one transaction
        spec(mx.array([[tok]]), cache=views)
    assert pc.speculation_start("a") == len(prompt)
    assert views[0].trim(2) == 2
    got = np.array(spec(mx.array([[30]]), cache=views)[0])
    want = reference_logits(model, prompt + [21, 30])[-1:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    pc.check_integrity()


def test_without_speculation_hybrid_views_say_so():
    model = built("lfm2")
    pc = paged(model)
    pc.allocate("a", prompt_of("lfm2"))
    plain = pc.views(["a"])
    model(mx.array([prompt_of("lfm2")]), cache=plain)
    assert not any(v.is_trimmable() for v in plain)  # mlx-lm refuses them, as before
    with pytest.raises(ValueError, match="trimmable"):
        next(speculative_generate_step(mx.array([1, 2]), model, model, prompt_cache=plain * 2))
    spec = pc.speculative_model(model, ["a"])
    before = pc.debug_state()
    assert [v.trim(3) for v in spec.cache] == [0] * len(spec.cache)  # nothing in flight
    assert pc.debug_state() == before


def test_bad_calls_change_nothing(hybrid):
    model, pc, spec, prompt = prefilled(hybrid)
    views = spec.cache
    spec(mx.array([[5, 6, 7]]), cache=views)
    before = pc.debug_state()
    with pytest.raises(InvalidArgument, match="holds 3"):
        views[0].trim(4)  # past the speculation's start
    with pytest.raises(InvalidArgument, match="own views"):
        spec(mx.array([[1]]), cache=pc.views(["a"]))
    with pytest.raises(InvalidArgument, match="SpeculativeModel"):
        model(mx.array([[1]]), cache=views)  # the bare model cannot tell the ids
    with pytest.raises(InvalidArgument, match="shape"):
        spec(mx.array([[1], [2]]), cache=views)
    assert pc.debug_state() == before
    pc.allocate("b", [1, 2, 3])
    other = pc.speculative_model(model, ["b"])
    before = pc.debug_state()
    with pytest.raises(InvalidArgument, match="reserved"):
        other(mx.array([[1, 9]]), cache=other.cache)  # not the reserved prompt
    assert pc.debug_state() == before


class Faulty:
    """`model` raising on its `fail_at`-th call (counting from 1)."""

    def __init__(self, model, fail_at: int) -> None:
        self.model, self.fail_at, self.calls = model, fail_at, 0
        self.layers = model.layers

    def __call__(self, x, cache=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected fault")
        return self.model(x, cache=cache)


@pytest.mark.parametrize("opens", [True, False], ids=["opening", "extending"])
def test_a_raising_forward_leaves_the_storage_as_before(hybrid, opens):
    model = built(hybrid)
    prompt = prompt_of(hybrid, 11)
    pc = paged(model)
    pc.allocate("a", prompt)
    faulty = Faulty(model, fail_at=2 if opens else 3)
    spec = pc.speculative_model(faulty, ["a"])
    spec(mx.array([prompt]), cache=spec.cache)
    if not opens:
        spec(mx.array([[21]]), cache=spec.cache)  # opens; the next call extends
    before = pc.debug_state()
    with pytest.raises(RuntimeError, match="injected"):
        spec(mx.array([[22, 23, 24]]), cache=spec.cache)
    assert pc.debug_state() == before
    pc.check_integrity()
    got = np.array(spec(mx.array([[22, 23, 24]]), cache=spec.cache)[0])  # the retry
    seq = prompt + ([21] if not opens else []) + [22, 23, 24]
    np.testing.assert_allclose(got, reference_logits(model, seq)[-3:], atol=TOL, rtol=0)
    pc.free("a")
    assert_all_released(pc)


def test_a_raising_target_inside_mlx_lms_loop_leaves_it_whole(hybrid):
    model = built(hybrid)
    prompt = prompt_of(hybrid)
    pc, dc = paged(model), paged(model)
    pc.allocate("a", prompt)
    dc.allocate("a", prompt)
    faulty = Faulty(model, fail_at=5)  # 2 prefill chunks + 2 rounds, then the 3rd round
    t, d = pc.speculative_model(faulty, ["a"]), dc.speculative_model(model, ["a"])
    got = []
    with pytest.raises(RuntimeError, match="injected"):
        for tok, _, _ in speculative_generate_step(
                mx.array(prompt), t, d, prompt_cache=t.cache + d.cache,
                num_draft_tokens=NUM_DRAFT, max_tokens=MAX_TOKENS, prefill_step_size=8):
            got.append(int(tok))
    assert got == greedy_reference(model, prompt, MAX_TOKENS)[:len(got)] and got
    assert pc.speculation_start("a") is None and pc.num_computed("a") == pc.num_tokens("a")
    for storage in (pc, dc):
        storage.check_integrity()
        storage.free("a")
        assert_all_released(storage)


def test_consecutive_rejections_keep_the_replay_bounded(hybrid):
    model, pc, spec, prompt = prefilled(hybrid)
    seq = list(prompt)
    for round_ in range(8):  # every draft rejected: the bonus token is kept each round
        bonus = 40 + round_
        assert pc.num_replay("a") <= 4 + 2  # past 4 + 1, this call runs it alone first
        got = np.array(spec(mx.array([[bonus, 1, 2, 3]]), cache=spec.cache)[0])
        want = reference_logits(model, seq + [bonus, 1, 2, 3])[-4:]
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        assert spec.cache[0].trim(3) == 3
        seq.append(bonus)
    assert pc.num_computed("a") >= len(prompt) + 8 - 5  # the replay ran alone on the way
    pc.check_integrity()


def test_a_batch_whose_rows_replay_different_lengths(hybrid):
    model = built(hybrid)
    pc = paged(model)
    prompts = {"a": prompt_of(hybrid, 9), "b": [(5 * i + 1) % vocab(hybrid) for i in range(9)]}
    for seq_id, prompt in prompts.items():
        pc.allocate(seq_id, prompt)
        alone = pc.speculative_model(model, [seq_id])
        alone(mx.array([prompt]), cache=alone.cache)
    alone(mx.array([[5, 6, 7]]), cache=alone.cache)
    assert alone.cache[0].trim(2) == 2  # b: one token to replay
    both = pc.speculative_model(model, ["a", "b"])
    assert pc.num_replay("a") == 0 and pc.num_replay("b") == 1
    both(mx.array([[1, 2, 3], [11, 12, 13]]), cache=both.cache)
    assert both.cache[0].trim(1) == 1
    assert pc.num_replay("a") == 2 and pc.num_replay("b") == 3
    got = np.array(both(mx.array([[4, 5, 6], [20, 21, 22]]), cache=both.cache))
    assert got.shape == (2, 3, vocab(hybrid))
    want_a = reference_logits(model, prompts["a"] + [1, 2, 4, 5, 6])[-3:]
    want_b = reference_logits(model, prompts["b"] + [5, 11, 12, 20, 21, 22])[-3:]
    np.testing.assert_allclose(got[0], want_a, atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], want_b, atol=TOL, rtol=0)
    pc.check_integrity()


def test_no_room_for_the_drafts_changes_nothing(hybrid):
    model = built(hybrid)
    pc = PagedCache.for_model(model, num_blocks=3, block_size=8, num_slots=2,
                              enable_prefix_cache=False)
    prompt = prompt_of(hybrid, 11)
    pc.allocate("a", prompt)
    spec = pc.speculative_model(model, ["a"])
    spec(mx.array([prompt[:10]]), cache=spec.cache)
    before = pc.debug_state()
    with pytest.raises(OutOfBlocks):
        spec(mx.array([[prompt[10]] + list(range(1, 16))]), cache=spec.cache)  # 4 pages
    assert pc.debug_state() == before
    got = np.array(spec(mx.array([[prompt[10], 1, 2]]), cache=spec.cache)[0])
    np.testing.assert_allclose(got, reference_logits(model, prompt + [1, 2])[-3:], atol=TOL,
                               rtol=0)
    pc.check_integrity()
