"""The recurrences of hybrid-model layers, in plain MLX, with padding masks.

* `causal_conv1d`: depthwise causal convolution continuing from a kept conv
  tail (LFM2 `ShortConv`, the Qwen3-Next / Mamba input conv).
* `gated_delta`: the gated delta rule (Qwen3-Next `GatedDeltaNet`).

Batches are right-padded: row `b` holds `lengths[b]` real tokens (or
`mask[b, t]` true) followed by padding. Padded positions never change the
state and their outputs are zero, so a padded row gives exactly the result
of the same row alone without padding.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from blockmgr.errors import InvalidArgument


def length_mask(lengths: mx.array, n: int) -> mx.array:
    """`[B, n]` bool mask, true at positions `t < lengths[b]`."""
    return mx.arange(n)[None, :] < lengths[:, None]


# ---- causal conv ------------------------------------------------------------


def causal_conv1d(
    x: mx.array,
    weight: mx.array,
    state: mx.array | None = None,
    lengths: mx.array | None = None,
    bias: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv of `x` continuing from `state`; returns `(y, next_state)`.

    * `x`: `[B, S, C]` new inputs, right-padded when `lengths` is given.
    * `weight`: `[C, K, 1]` (the layout of `mlx.nn.Conv1d(groups=C)`) or `[C, K]`.
    * `state`: `[B, K-1, C]`, the last `K-1` inputs before `x` (`None` = zeros).
    * `lengths`: `[B]` int, real tokens per row (`None` = all `S` are real).

    `y[b, t, c] = sum_j w[c, j] * z[b, t + j, c]` with `z = concat(state, x)`
    (cross-correlation, as `mx.conv1d`), plus `bias`; zero at padded
    positions. `next_state[b]` is the `K-1` inputs ending at row `b`'s real
    end (the old state shifted by `lengths[b]`; unchanged for a row with no
    tokens). Dtype follows `x`. Cost: K fused multiply-adds over `[B, S, C]`.
    """
    if x.ndim != 3:
        raise InvalidArgument(f"x must be [B, S, C], got {tuple(x.shape)}")
    B, S, C = x.shape
    w = weight.reshape(weight.shape[0], -1) if weight.ndim == 3 else weight
    if w.ndim != 2 or w.shape[0] != C:
        raise InvalidArgument(f"weight must be [C={C}, K(, 1)], got {tuple(weight.shape)}")
    K = w.shape[1]
    if state is None:
        state = mx.zeros((B, K - 1, C), dtype=x.dtype)
    elif tuple(state.shape) != (B, K - 1, C):
        raise InvalidArgument(f"state must be {(B, K - 1, C)}, got {tuple(state.shape)}")
    mask = None
    if lengths is not None:
        _check_lengths(lengths, B)
        mask = length_mask(lengths, S)[..., None]
        x = mx.where(mask, x, mx.zeros((), dtype=x.dtype))  # padding must not enter the tail
    z = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+S, C]
    w = w.astype(x.dtype)
    y = z[:, 0:S, :] * w[:, 0]
    for j in range(1, K):
        y = y + z[:, j : j + S, :] * w[:, j]
    if bias is not None:
        y = y + bias.astype(x.dtype)
    if mask is not None:
        y = mx.where(mask, y, mx.zeros((), dtype=y.dtype))
    return y, _conv_tail(z, lengths, K - 1)


def _conv_tail(z: mx.array, lengths: mx.array | None, keep: int) -> mx.array:
    """The `keep` inputs of `z` ending at each row's real end."""
    if lengths is None:
        return mx.contiguous(z[:, z.shape[1] - keep :, :])
    S = z.shape[1] - keep
    ends = mx.clip(lengths.astype(mx.int32), 0, S)
    positions = (ends[:, None] + mx.arange(keep))[..., None]  # [B, keep, 1]
    return mx.take_along_axis(z, positions, axis=1)


# ---- gated delta rule -----------------------------------------------------------


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Gated delta rule over `T` steps; returns `(y, next_state)`.

    Per step and head, with `S` the `[Dv, Dk]` state:
    `S <- g * S;  S <- S + beta * (v - S k) k^T;  y = S q`.

    * `q`, `k`: `[B, T, Hk, Dk]` (already normalized and scaled by the caller);
    * `v`: `[B, T, Hv, Dv]`, `Hv` a multiple of `Hk` (key heads are shared);
    * `g`: decay, `[B, T, Hv]` or per key channel `[B, T, Hv, Dk]`;
    * `beta`: `[B, T, Hv]`;
    * `state`: `[B, Hv, Dv, Dk]` (`None` = zeros), kept in float32;
    * `mask`: `[B, T]` bool, false at padded steps: state kept, `y` zero.

    `y` is `[B, T, Hv, Dv]` in `q`'s dtype; the state is float32 whatever the
    input dtype. Cost: `T` sequential steps of O(B * Hv * Dv * Dk).
    """
    B, T, Hk, Dk = _check_delta_shapes(q, k, v, g, beta, state, mask)
    Hv = v.shape[2]
    if state is None:
        state = mx.zeros((B, Hv, v.shape[3], Dk), dtype=mx.float32)
    if Hv != Hk:  # grouped heads: each key head serves Hv // Hk value heads
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    state = state.astype(mx.float32)
    ys = []
    for t in range(T):
        if mask is None:
            y, state = _delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        else:
            y, state = _delta_step_masked(
                q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, mask[:, t]
            )
        ys.append(y)
    y = mx.stack(ys, axis=1) if ys else mx.zeros((B, 0, Hv, v.shape[3]), dtype=mx.float32)
    return y.astype(q.dtype), state


def _delta_update(q, k, v, g, beta, state):
    """One step in float32: q, k `[B, H, Dk]`, v `[B, H, Dv]`, state `[B, H, Dv, Dk]`."""
    f32 = mx.float32
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    decay = g[..., None, None] if g.ndim == 2 else g[..., None, :]
    state = state * decay
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # S k: [B, H, Dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + delta[..., None] * k[..., None, :]
    y = (state * q[..., None, :]).sum(axis=-1)  # S q: [B, H, Dv]
    return y, state


@partial(mx.compile, shapeless=True)
def _delta_step(q, k, v, g, beta, state):
    return _delta_update(q, k, v, g, beta, state)


@partial(mx.compile, shapeless=True)
def _delta_step_masked(q, k, v, g, beta, state, m):
    y, new_state = _delta_update(q, k, v, g, beta, state)
    keep = m[:, None, None, None]
    return mx.where(m[:, None, None], y, 0.0), mx.where(keep, new_state, state)


def _check_delta_shapes(q, k, v, g, beta, state, mask) -> tuple[int, int, int, int]:
    if q.ndim != 4 or tuple(k.shape) != tuple(q.shape):
        raise InvalidArgument(f"q, k must be equal [B, T, Hk, Dk], got {q.shape}, {k.shape}")
    B, T, Hk, Dk = q.shape
    if v.ndim != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] % Hk:
        raise InvalidArgument(f"v must be [B, T, Hv, Dv] with Hk | Hv, got {v.shape}")
    Hv, Dv = v.shape[2], v.shape[3]
    if tuple(g.shape) not in ((B, T, Hv), (B, T, Hv, Dk)):
        raise InvalidArgument(f"g must be [B, T, Hv] or [B, T, Hv, Dk], got {g.shape}")
    if tuple(beta.shape) != (B, T, Hv):
        raise InvalidArgument(f"beta must be [B, T, Hv], got {beta.shape}")
    if state is not None and tuple(state.shape) != (B, Hv, Dv, Dk):
        raise InvalidArgument(f"state must be {(B, Hv, Dv, Dk)}, got {state.shape}")
    if mask is not None and tuple(mask.shape) != (B, T):
        raise InvalidArgument(f"mask must be [B, T], got {mask.shape}")
    return B, T, Hk, Dk


def _check_lengths(lengths: mx.array, batch: int) -> None:
    if lengths.ndim != 1 or lengths.shape[0] != batch:
        raise InvalidArgument(f"lengths must be [{batch}], got {tuple(lengths.shape)}")
