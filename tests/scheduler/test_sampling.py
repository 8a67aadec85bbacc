"""Sampling against naive per-row references: filters (top-k, min-p,
top-p), logit bias and penalties, seeded draws, and the engine's greedy
outputs and logprobs against a plain loop over mlx-lm's own caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from scheduler import Engine, SamplingParams
from scheduler.engine.sampling import (
    KeyChain,
    adjust_logits,
    filtered_logprobs,
    sample_rows,
    token_logprobs,
)

V = 50


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def naive_filtered(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """One row: log_softmax, then top-p (keep a token when the tokens more
    likely than it hold less than top_p), min-p, top-k (by rank)."""
    lp = log_softmax(logits)
    probs = np.exp(lp)
    keep = np.ones(len(lp), dtype=bool)
    if p.top_p < 1.0:
        for i in range(len(lp)):
            keep[i] &= probs[probs > probs[i]].sum() < p.top_p
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_k is not None:
        rank = np.argsort(np.argsort(-lp))
        keep &= rank < p.top_k
    return np.where(keep, lp, -np.inf)


def naive_adjusted(logits: np.ndarray, p: SamplingParams, prompt, output) -> np.ndarray:
    """One row: bias, then repetition (prompt + output), presence and
    frequency (output) penalties, token by token."""
    x = logits.astype(np.float64).copy()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    seen = set(prompt) | set(output)
    for token in range(len(x)):
        if token in seen and p.repetition_penalty != 1.0:
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else \
                x[token] * p.repetition_penalty
        count = list(output).count(token)
        if count:
            x[token] -= p.presence_penalty + p.frequency_penalty * count
    return x


ROW_PARAMS = [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, min_p=0.3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, top_k=7),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.5),
]


def random_logits(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, size=(rows, V)).astype(np.float32)


@pytest.mark.parametrize("seed", range(3))
def test_filters_match_a_naive_row_loop(seed):
    logits = random_logits(len(ROW_PARAMS), seed)
    for r, p in enumerate(ROW_PARAMS):
        got = np.array(filtered_logprobs(mx.array(logits[r : r + 1]), p))[0]
        want = naive_filtered(logits[r], p)
        assert np.array_equal(np.isfinite(got), np.isfinite(want)), p
        kept = np.isfinite(want)
        np.testing.assert_allclose(got[kept], want[kept], rtol=1e-5, atol=1e-5)


def _histories(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, V, size=rng.integers(1, 12)).tolist(),
         rng.integers(0, V, size=rng.integers(0, 15)).tolist())
        for _ in range(rows)
    ]


PENALTY_PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.8),
    SamplingParams(frequency_penalty=0.5, presence_penalty=-0.4),
    SamplingParams(),
    SamplingParams(repetition_penalty=0.7, frequency_penalty=1.5, logit_bias={3: 5.0, 9: -2}),
    SamplingParams(logit_bias={0: 100.0}),
]


@pytest.mark.parametrize("seed", range(4))
def test_bias_and_penalties_match_a_naive_row_loop(seed):
    logits = random_logits(len(PENALTY_PARAMS), seed)
    histories = _histories(len(PENALTY_PARAMS), seed)
    got = np.array(adjust_logits(mx.array(logits), PENALTY_PARAMS, histories))
    for r, p in enumerate(PENALTY_PARAMS):
        want = naive_adjusted(logits[r], p, *histories[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_sample_rows_draws_what_the_reference_distribution_gives(seed):
    """Greedy rows take the argmax of the adjusted logits; a seeded row's
    token is the categorical draw, with the same key, from the naive
    reference's logprobs / T (rows of different kinds in one call)."""
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.9, top_k=4, presence_penalty=1.0, seed=11 + seed),
        SamplingParams(temperature=1.2, min_p=0.2, seed=5 + seed),
        SamplingParams(temperature=0.8, top_p=0.7, logit_bias={2: 3.0}, seed=seed),
        SamplingParams(temperature=0.0, logit_bias={7: 50.0}),
    ]
    logits = random_logits(len(params), seed)
    histories = _histories(len(params), seed)
    keys = [KeyChain(p.seed) if p.seed is not None else None for p in params]
    got = np.array(sample_rows(mx.array(logits), params, keys, histories))
    for r, p in enumerate(params):
        adjusted = naive_adjusted(logits[r], p, *histories[r])
        if p.greedy:
            assert got[r] == np.argmax(adjusted)
            continue
        reference = naive_filtered(adjusted.astype(np.float32), p) / p.temperature
        key = KeyChain(p.seed).next()
        want = mx.random.categorical(mx.array(reference[None].astype(np.float32)), key=key)[0]
        assert got[r] == want.item()
        assert np.isfinite(reference[got[r]])


def test_token_logprobs_are_log_softmax():
    logits = random_logits(4, 0)
    tokens = mx.array([3, 1, 4, 1])
    got = token_logprobs(mx.array(logits), tokens, [2, None, 0, 5])
    assert got[1] is None
    for r in (0, 2, 3):
        lp = log_softmax(logits[r])
        assert got[r].token == int(tokens[r].item())
        assert got[r].logprob == pytest.approx(lp[got[r].token], abs=1e-5)
        order = np.argsort(-lp)
        k = [2, None, 0, 5][r]
        assert [t for t, _ in got[r].top] == order[:k].tolist()
        np.testing.assert_allclose([v for _, v in got[r].top], lp[order[:k]], atol=1e-5)


# ------------------------------------------------------------ engine-level


def naive_loop(model, prompt, params: SamplingParams, max_tokens: int):
    """mlx-lm's model and caches, one token at a time; numpy penalties and
    argmax; returns (tokens, log_softmax rows of the raw logits)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    tokens, rows = [], []
    for _ in range(max_tokens):
        raw = np.array(logits.astype(mx.float32))
        rows.append(log_softmax(raw))
        token = int(np.argmax(naive_adjusted(raw, params, prompt, tokens)))
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return tokens, rows


PROMPTS = ["Hello world", "The quick brown fox jumps", "A prefix trie shares"]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.7,
                       ignore_eos=True),
        SamplingParams(max_tokens=16, logit_bias={5: 4.0, 17: 3.0}, ignore_eos=True,
                       frequency_penalty=2.0),
    ],
)
def test_engine_penalties_match_a_naive_loop(tiny, params):
    model, tok = tiny
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok)
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = engine.generate(PROMPTS * 2, [params] * len(PROMPTS) + [plain] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        want, _ = naive_loop(model, tok.encode(prompt), params, 16)
        assert out.tokens == want
    for prompt, out in zip(PROMPTS, outs[len(PROMPTS):]):
        want, _ = naive_loop(model, tok.encode(prompt), plain, 16)
        assert out.tokens == want
    assert outs[0].tokens != outs[len(PROMPTS)].tokens  # the penalty changed something


def test_engine_logprobs_are_log_softmax_of_mlx_lm_logits(tiny):
    model, tok = tiny
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok)
    params = [SamplingParams(max_tokens=8, logprobs=k, ignore_eos=True) for k in (0, 3, 20)]
    outs = engine.generate(PROMPTS, params)
    for prompt, out, k in zip(PROMPTS, outs, (0, 3, 20)):
        tokens, rows = naive_loop(model, tok.encode(prompt), SamplingParams(), 8)
        assert out.tokens == tokens
        assert [e.token for e in out.logprobs[0]] == tokens
        for entry, lp in zip(out.logprobs[0], rows):
            assert entry.logprob == pytest.approx(lp[entry.token], abs=1e-4)
            order = np.argsort(-lp)[:k]
            assert [t for t, _ in entry.top] == order.tolist()
            np.testing.assert_allclose([v for _, v in entry.top], lp[order], atol=1e-4)


def test_logprobs_with_n_samples_follow_each_sample(tiny):
    model, tok = tiny
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok)
    params = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=4, logprobs=2,
                            ignore_eos=True)
    (out,) = engine.generate(["Hello world"], params)
    prompt = tok.encode("Hello world")
    for tokens, entries in zip(out.outputs, out.logprobs):
        assert [e.token for e in entries] == tokens
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt + tokens]), cache=cache)[0]
        for i, entry in enumerate(entries):
            lp = log_softmax(np.array(logits[len(prompt) - 1 + i]))
            assert entry.logprob == pytest.approx(lp[entry.token], abs=1e-4)
    engine.check_integrity()


def _ban_small_ids(tokens, logits):
    """Bans ids below 200 and the last token (depends on the history)."""
    banned = mx.arange(logits.shape[-1]) < 200
    banned = banned | (mx.arange(logits.shape[-1]) == tokens[-1])
    return mx.where(banned, -mx.inf, logits)


def test_user_logits_processors_match_mlx_lm_generate_step(tiny):
    from mlx_lm.generate import generate_step

    model, tok = tiny
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok)
    params = SamplingParams(max_tokens=10, logits_processors=[_ban_small_ids], ignore_eos=True)
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = engine.generate(PROMPTS + PROMPTS[:1], [params] * len(PROMPTS) + [plain])
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        want = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=10,
                                                  logits_processors=[_ban_small_ids])]
        assert out.tokens == want
        assert all(t >= 200 for t in out.tokens)
    assert any(t < 200 for t in outs[-1].tokens)  # the processor changed something


def test_a_raising_logits_processor_aborts_its_request_only(tiny):
    from scheduler.core.request import RequestStatus

    model, tok = tiny

    def broken(tokens, logits):
        raise RuntimeError("processor fault")

    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok)
    outs = engine.generate(PROMPTS[:2], [
        SamplingParams(max_tokens=6, logits_processors=[broken], ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True)])
    assert outs[0].finish_reasons == [RequestStatus.FINISHED_ABORTED]
    ids = tok.encode(PROMPTS[1])
    want, _ = naive_loop(model, ids, SamplingParams(), 6)
    assert outs[1].tokens == want
    assert engine.cache.block_manager.num_sequences == 0
    engine.check_integrity()
