"""recurrent.ops against naive per-token loops (numpy, float64) and mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from blockmgr.errors import InvalidArgument
from recurrent.ops import causal_conv1d, gated_delta, length_mask

TOL = 1e-5


def np64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


# ---- naive references ------------------------------------------------------


def naive_conv(x, w, state):
    """Per-token depthwise causal conv: x [S, C], w [C, K], state [K-1, C]."""
    K = w.shape[1]
    window = list(state)  # the last K-1 inputs
    ys = []
    for t in range(x.shape[0]):
        window.append(x[t])
        ys.append(sum(w[:, j] * window[j] for j in range(K)))
        window.pop(0)
    return np.array(ys).reshape(x.shape[0], -1), np.array(window).reshape(K - 1, -1)


def naive_delta(q, k, v, g, beta, state):
    """Per-token gated delta rule for one sequence, every head separately.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] or [T, Hv, Dk]; beta [T, Hv];
    state [Hv, Dv, Dk].
    """
    T, Hk, _ = q.shape
    Hv = v.shape[1]
    S = state.copy()
    ys = np.zeros((T, Hv, v.shape[2]))
    for t in range(T):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            decay = g[t, h] if g.ndim == 2 else g[t, h][None, :]
            S[h] = S[h] * decay
            err = v[t, h] - S[h] @ k[t, hk]
            S[h] = S[h] + beta[t, h] * np.outer(err, k[t, hk])
            ys[t, h] = S[h] @ q[t, hk]
    return ys, S


# ---- causal_conv1d -------------------------------------------------------------


@pytest.mark.parametrize("K", [2, 3, 4])
def test_conv_matches_naive_loop(K):
    mx.random.seed(K)
    B, S, C = 3, 7, 5
    x = mx.random.normal((B, S, C))
    w = mx.random.normal((C, K, 1))
    state = mx.random.normal((B, K - 1, C))
    y, nxt = causal_conv1d(x, w, state)
    for b in range(B):
        ry, rs = naive_conv(np64(x[b]), np64(w[..., 0]), np64(state[b]))
        np.testing.assert_allclose(np64(y[b]), ry, atol=TOL)
        np.testing.assert_allclose(np64(nxt[b]), rs, atol=TOL)


def test_conv_matches_mlx_grouped_conv_and_bias():
    """mlx-lm runs these layers with nn.Conv1d(groups=C) over concat(state, x)."""
    mx.random.seed(3)
    B, S, C, K = 2, 6, 8, 4
    layer = nn.Conv1d(C, C, kernel_size=K, groups=C, bias=True)
    x = mx.random.normal((B, S, C))
    state = mx.random.normal((B, K - 1, C))
    y, nxt = causal_conv1d(x, layer.weight, state, bias=layer.bias)
    ref = layer(mx.concatenate([state, x], axis=1))
    np.testing.assert_allclose(np64(y), np64(ref), atol=TOL)
    np.testing.assert_allclose(np64(nxt), np64(x[:, -(K - 1) :]), atol=0)


def test_conv_matches_mlx_lm_shortconv_with_padding():
    """LFM2's ShortConv over an mlx-lm ArraysCache with right-padded lengths."""
    from mlx_lm.models import lfm2
    from mlx_lm.models.cache import ArraysCache

    mx.random.seed(4)
    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=16, hidden_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        norm_eps=1e-5, conv_bias=True, conv_L_cache=3, block_dim=12,
        block_multiple_of=4, block_ffn_dim_multiplier=None,
        block_auto_adjust_ff_dim=False, block_ff_dim=16,
        layer_types=["conv", "full_attention"],
    )
    layer = lfm2.ShortConv(args, 0)
    B, S = 3, 5
    lengths = mx.array([5, 2, 0])
    x = mx.random.normal((B, S, 12))
    state = mx.random.normal((B, 2, 12))
    cache = ArraysCache(size=1)
    cache[0] = state
    cache.prepare(lengths=[5, 2, 0])
    ref = layer(x, mask=cache.make_mask(S), cache=cache)

    Bg, Cg, xx = mx.split(layer.in_proj(x), 3, axis=-1)
    y, nxt = causal_conv1d(Bg * xx, layer.conv.weight, state, lengths, bias=layer.conv.bias)
    ours = layer.out_proj(Cg * y)
    m = np.array(length_mask(lengths, S))
    np.testing.assert_allclose(np64(ours)[m], np64(ref)[m], atol=TOL)
    np.testing.assert_allclose(np64(nxt), np64(cache[0]), atol=TOL)


def test_conv_padded_rows_equal_unpadded_rows():
    mx.random.seed(5)
    B, S, C, K = 4, 6, 5, 4
    lengths = [6, 3, 1, 0]
    x = mx.random.normal((B, S, C))
    w = mx.random.normal((C, K))
    state = mx.random.normal((B, K - 1, C))
    y, nxt = causal_conv1d(x, w, state, mx.array(lengths))
    for b, n in enumerate(lengths):
        ry, rs = causal_conv1d(x[b : b + 1, :n], w, state[b : b + 1])
        np.testing.assert_allclose(np64(y[b, :n]), np64(ry[0]), atol=TOL)
        np.testing.assert_allclose(np64(y[b, n:]), 0.0, atol=0)  # padding outputs zero
        np.testing.assert_allclose(np64(nxt[b]), np64(rs[0]), atol=0)
    np.testing.assert_array_equal(np64(nxt[3]), np64(state[3]))  # no tokens: tail kept


def test_conv_default_state_is_zeros_and_keeps_dtype():
    x = mx.random.normal((1, 4, 3)).astype(mx.bfloat16)
    w = mx.random.normal((3, 3))
    y, nxt = causal_conv1d(x, w)
    y0, n0 = causal_conv1d(x, w, mx.zeros((1, 2, 3), dtype=mx.bfloat16))
    assert y.dtype == mx.bfloat16 and nxt.dtype == mx.bfloat16
    np.testing.assert_array_equal(np64(y), np64(y0))


def test_conv_rejects_bad_shapes():
    x = mx.zeros((2, 3, 4))
    with pytest.raises(InvalidArgument):
        causal_conv1d(x, mx.zeros((5, 3)))
    with pytest.raises(InvalidArgument):
        causal_conv1d(x, mx.zeros((4, 3)), state=mx.zeros((2, 3, 4)))
    with pytest.raises(InvalidArgument):
        causal_conv1d(x, mx.zeros((4, 3)), lengths=mx.array([1, 2, 3]))


# ---- gated_delta ----------------------------------------------------------------


def delta_inputs(seed, B=2, T=6, Hk=2, Hv=4, Dk=8, Dv=5, vector_g=False):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) / Dk
    k = mx.random.normal((B, T, Hk, Dk)) / np.sqrt(Dk)
    v = mx.random.normal((B, T, Hv, Dv))
    g_shape = (B, T, Hv, Dk) if vector_g else (B, T, Hv)
    g = mx.random.uniform(low=0.5, high=1.0, shape=g_shape)
    beta = mx.random.uniform(shape=(B, T, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("vector_g", [False, True])
@pytest.mark.parametrize("Hk", [1, 2, 4])
def test_delta_matches_naive_loop(vector_g, Hk):
    q, k, v, g, beta, state = delta_inputs(10 + Hk, Hk=Hk, vector_g=vector_g)
    y, nxt = gated_delta(q, k, v, g, beta, state)
    assert nxt.dtype == mx.float32
    for b in range(q.shape[0]):
        ry, rs = naive_delta(*(np64(a[b]) for a in (q, k, v, g, beta, state)))
        np.testing.assert_allclose(np64(y[b]), ry, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np64(nxt[b]), rs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vector_g", [False, True])
def test_delta_matches_mlx_lm(vector_g):
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, state = delta_inputs(20, vector_g=vector_g)
    y, nxt = gated_delta(q, k, v, g, beta, state)
    ry, rs = gated_delta_ops(q, k, v, g, beta, state)
    np.testing.assert_allclose(np64(y), np64(ry), atol=TOL)
    np.testing.assert_allclose(np64(nxt), np64(rs), atol=TOL)


def test_delta_padded_rows_equal_unpadded_rows_and_mlx_lm_mask():
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, state = delta_inputs(30, B=3, T=5)
    lengths = [5, 2, 0]
    mask = length_mask(mx.array(lengths), 5)
    y, nxt = gated_delta(q, k, v, g, beta, state, mask)
    ry, rs = gated_delta_ops(q, k, v, g, beta, state, mask)
    np.testing.assert_allclose(np64(nxt), np64(rs), atol=TOL)
    for b, n in enumerate(lengths):
        row = [a[b : b + 1, :n] for a in (q, k, v, g, beta)]
        uy, us = gated_delta(*row, state[b : b + 1])
        np.testing.assert_allclose(np64(y[b, :n]), np64(uy[0]), atol=TOL)
        np.testing.assert_allclose(np64(ry[b, :n]), np64(uy[0]), atol=TOL)
        np.testing.assert_allclose(np64(y[b, n:]), 0.0, atol=0)
        np.testing.assert_allclose(np64(nxt[b]), np64(us[0]), atol=TOL)
    np.testing.assert_array_equal(np64(nxt[2]), np64(state[2]))


def test_delta_low_precision_inputs_keep_float32_state():
    q, k, v, g, beta, state = delta_inputs(40)
    half = [a.astype(mx.bfloat16) for a in (q, k, v)]
    y, nxt = gated_delta(*half, g, beta, None)
    ry, rs = gated_delta(*(a.astype(mx.float32) for a in half), g, beta, None)
    assert y.dtype == mx.bfloat16 and nxt.dtype == mx.float32
    np.testing.assert_allclose(np64(nxt), np64(rs), atol=1e-5)


def test_delta_rejects_bad_shapes():
    q, k, v, g, beta, state = delta_inputs(50)
    with pytest.raises(InvalidArgument):
        gated_delta(q, k[:, :3], v, g, beta, state)
    with pytest.raises(InvalidArgument):
        gated_delta(q, k, v, g[..., :1], beta, state)
    with pytest.raises(InvalidArgument):
        gated_delta(q, k, v, g, beta, state[:, :1])
    with pytest.raises(InvalidArgument):
        gated_delta(q, k, v, g, beta, state, mx.ones((2, 2), dtype=mx.bool_))
