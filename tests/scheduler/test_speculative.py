"""Speculative decoding in the Engine, against mlx-lm and the exact target distribution.

Greedy: outputs with a draft model equal mlx-lm's `generate_step` on the
target alone (and the Engine without a draft), for an attention and three
hybrid models (recurrent_gemma: recurrent + sliding-window layers, whose
window keeps the pages a restored checkpoint's recompute attends to), with
a draft that agrees often (the target plus small noise) and one that
rarely does (large noise), at batch 1 and 8, with prefix hits and under
preemption. Sampling: the empirical distribution of the first
token and of the first speculated token matches the target's softmax
(total variation bound) with and without a draft, on a vocabulary of 8.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

from scheduler import Engine, SamplingParams
from tests.leaks import assert_only_the_cache_holds
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak, assert_preempted, make_prompts
from tests.tiny_models import _BUILDERS, ATTENTION_VOCAB, HYBRID_VOCAB, built

MAX_TOKENS = 10
VOCABS = {"llama": ATTENTION_VOCAB, "lfm2": HYBRID_VOCAB, "qwen3_next": HYBRID_VOCAB,
          "recurrent_gemma": HYBRID_VOCAB}
#: Noise (times each weight's std) of the draft: agrees often / rarely.
NOISE = {"agrees": 0.005, "disagrees": 3.0}
_refs: dict = {}
_drafts: dict = {}


def noisy_copy(name: str, scale: float, seed: int = 5):
    """A fresh build of `name` with Gaussian noise of `scale` x std per weight."""
    model = _BUILDERS[name]()
    mx.random.seed(seed)

    def perturb(w):
        if not mx.issubdtype(w.dtype, mx.floating) or w.size < 2:
            return w
        return w + scale * mx.std(w) * mx.random.normal(w.shape, dtype=w.dtype)

    model.update(tree_map(perturb, model.parameters()))
    mx.eval(model.parameters())
    return model


def draft(name: str, kind: str):
    if (name, kind) not in _drafts:
        _drafts[name, kind] = noisy_copy(name, NOISE[kind])
    return _drafts[name, kind]


def refs(name: str):
    """(prompts, mlx-lm greedy outputs) of 8 prompts sharing prefixes."""
    if name not in _refs:
        prompts = make_prompts(VOCABS[name])[:8]
        _refs[name] = prompts, [greedy_reference(built(name), p, MAX_TOKENS) for p in prompts]
    return _refs[name]


def assert_draft_no_leak(engine):
    engine.check_integrity()
    assert_only_the_cache_holds(engine.speculator.draft_cache.store)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["agrees", "disagrees"])
@pytest.mark.parametrize("name", ["llama", "lfm2", "qwen3_next", "recurrent_gemma"])
def test_greedy_with_a_draft_equals_mlx_lm(name, kind, batch):
    prompts, want = refs(name)
    engine = Engine(built(name), num_blocks=256, block_size=8, max_num_batched_tokens=96,
                    max_num_seqs=8, draft_model=draft(name, kind), num_speculative_tokens=3)
    outs = engine.generate(prompts[:batch], SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outs] == want[:batch]
    stats = engine.stats
    assert stats.num_draft_tokens > 0
    if kind == "agrees":
        assert stats.acceptance_rate > 0.6
    else:
        assert stats.acceptance_rate < 0.6  # rejections happen
        # hybrid: rejections restore checkpoints and recompute; attention never does
        assert (stats.num_recomputed_tokens > 0) == (name != "llama")
    if batch == 8:  # the same prompts again hit both models' prefix caches
        again = engine.generate(prompts[:batch], SamplingParams(max_tokens=MAX_TOKENS))
        assert [o.tokens for o in again] == want[:batch]
        assert engine.scheduler.stats.num_prefix_hit_tokens_total > 0
        assert engine.speculator.draft_cache.store.stats.num_hit_tokens > 0
    assert_no_leak(engine)
    assert_draft_no_leak(engine)


@pytest.mark.parametrize("batch", [4, 8])
@pytest.mark.parametrize("name", ["llama", "lfm2", "recurrent_gemma"])
def test_greedy_with_a_draft_equals_the_engine_without_one(name, batch):
    prompts, _ = refs(name)
    prompts = prompts[:batch]
    params = SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.3,
                            logit_bias={3: 2.0}, stop_token_ids=(7,))
    plain = Engine(built(name), num_blocks=256, block_size=8, max_num_seqs=8)
    want = [o.outputs for o in plain.generate(prompts, params)]
    engine = Engine(built(name), num_blocks=256, block_size=8, max_num_seqs=8,
                    draft_model=draft(name, "agrees"), num_speculative_tokens=4)
    assert [o.outputs for o in engine.generate(prompts, params)] == want
    assert engine.stats.num_accepted_tokens > 0
    assert_no_leak(engine)
    assert_draft_no_leak(engine)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["llama", "lfm2", "recurrent_gemma"])
def test_tiny_pool_preempts_and_outputs_stay_equal(name, preemption):
    prompts, want = refs(name)
    engine = Engine(built(name), num_blocks=14, block_size=8, max_num_batched_tokens=64,
                    max_num_seqs=8, preemption=preemption, num_host_blocks=64,
                    num_host_slots=16, draft_model=draft(name, "disagrees"),
                    num_speculative_tokens=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outs] == want
    assert_preempted(engine, preemption)
    assert engine.stats.num_draft_tokens > 0
    assert_no_leak(engine)
    assert_draft_no_leak(engine)


def test_n4_and_abort_with_a_draft():
    prompts, want = refs("lfm2")
    engine = Engine(built("lfm2"), num_blocks=128, block_size=8,
                    draft_model=draft("lfm2", "agrees"), num_speculative_tokens=3)
    victim = engine.add_request(prompts[1], SamplingParams(max_tokens=MAX_TOKENS))
    (out,) = engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, n=4))
    assert out.outputs == [want[2]] * 4
    engine.abort(victim)  # mid-generation, between steps
    engine.step()  # the draft copy of the aborted request is released
    assert engine.stats.num_accepted_tokens > 0
    assert_no_leak(engine)
    assert_draft_no_leak(engine)


class Flaky:
    """A model whose calls number `failing` raise (1-based)."""

    def __init__(self, model, failing) -> None:
        self.model, self.failing, self.calls = model, set(failing), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.failing:
            raise RuntimeError("injected forward fault")
        return self.model(*args, **kwargs)


@pytest.mark.parametrize("which", ["draft_model", "model"])
@pytest.mark.parametrize("name", ["lfm2", "recurrent_gemma"])
def test_a_failing_draft_or_verification_forward_is_retried_and_leaks_nothing(name, which):
    """The round counts as never run: both transactions are aborted, the
    rows run again (alone, without drafts) and the outputs stay right."""
    prompts, want = refs(name)
    engine = Engine(built(name), num_blocks=128, block_size=8,
                    draft_model=draft(name, "agrees"), num_speculative_tokens=3)
    speculator = engine.speculator
    setattr(speculator, which, Flaky(getattr(speculator, which), failing=(2,)))
    outs = engine.generate(prompts[:4], SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outs] == want[:4]
    assert engine.stats.num_forward_errors == 1
    assert engine.stats.num_accepted_tokens > 0
    assert_no_leak(engine)
    assert_draft_no_leak(engine)


def test_bad_speculation_settings_are_refused():
    with pytest.raises(ValueError):
        Engine(built("llama"), num_blocks=32, draft_model=built("llama"),
               num_speculative_tokens=0)
    with pytest.raises(ValueError):
        Engine(built("llama"), num_blocks=32, draft_model=built("lfm2"))  # vocab 61 != 101


# ---------------------------------------------------------------- sampling

SMALL_VOCAB = 8
PROMPT = [1, 5, 2, 7, 3]
NUM_RUNS = 1000


def tiny_vocab_llama(noise: float = 0.0):
    """A llama over 8 tokens; `noise` > 0: a draft of it (its distributions
    overlap the target's, so both acceptance and the residual draw matter)."""
    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=SMALL_VOCAB,
    )
    mx.random.seed(21)
    model = llama.Model(args)
    model.update(tree_map(lambda w: w * 1.5, model.parameters()))  # less uniform
    if noise:
        mx.random.seed(9)
        model.update(tree_map(lambda w: w + noise * mx.std(w) * mx.random.normal(w.shape),
                              model.parameters()))
    mx.eval(model.parameters())
    return model


def next_probs(model, tokens, temperature, top_k=None) -> np.ndarray:
    """The target's sampling distribution after `tokens` (no cache: a reference)."""
    logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
    if top_k is not None:
        kth = mx.sort(logits)[-top_k]
        logits = mx.where(logits >= kth, logits, -mx.inf)
    return np.array(mx.softmax(logits / temperature))


def second_token_probs(model, temperature, top_k=None) -> np.ndarray:
    """P(t2) = sum over t1 of P(t1) P(t2 | t1): the first speculated token."""
    first = next_probs(model, PROMPT, temperature, top_k)
    return sum(first[t] * next_probs(model, PROMPT + [t], temperature, top_k)
               for t in range(SMALL_VOCAB))


def total_variation(samples, probs) -> float:
    counts = np.bincount(samples, minlength=SMALL_VOCAB) / len(samples)
    return 0.5 * float(np.abs(counts - probs).sum())


@pytest.mark.parametrize("top_k", [None, 4])
def test_sampled_tokens_follow_the_target_distribution(top_k):
    """Empirical first and second tokens over many runs vs the exact target
    distribution: within a TV bound with and without a draft, while the
    draft's own distribution is far outside it (the test can tell)."""
    target, other = tiny_vocab_llama(), tiny_vocab_llama(noise=0.6)
    temperature = 1.0
    want_first = next_probs(target, PROMPT, temperature, top_k)
    want_second = second_token_probs(target, temperature, top_k)
    assert total_variation_of(second_token_probs(other, temperature, top_k), want_second) > 0.15
    params = SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k)
    for draft_model in (None, other) if top_k is None else (other,):
        engine = Engine(target, num_blocks=512, block_size=4, max_num_seqs=64,
                        draft_model=draft_model, num_speculative_tokens=2)
        mx.random.seed(1234)  # unseeded requests draw from the global generator: fixed
        outs = engine.generate([PROMPT] * NUM_RUNS, params)
        first = [o.tokens[0] for o in outs]
        second = [o.tokens[1] for o in outs]
        tv = total_variation(first, want_first), total_variation(second, want_second)
        print(f"draft={draft_model is not None} top_k={top_k} TV first, second: {tv}")
        assert max(tv) < 0.06
        if draft_model is not None:
            assert engine.stats.num_draft_tokens > 0
            assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
        assert_no_leak(engine)


def total_variation_of(p, q) -> float:
    return 0.5 * float(np.abs(np.asarray(p) - np.asarray(q)).sum())
