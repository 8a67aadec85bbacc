"""Quantized KV pages on tiny models, against mlx-lm's own quantized cache.

Every forward's logits are compared with the same model on
`tests.quant_models.reference_caches`: mlx-lm's ``QuantizedKVCache`` from the
first token at the same bits and group size (windowed for sliding layers),
or, for separate key/value bits and attention sinks (which mlx-lm's
quantized attention cannot run), mlx-lm's caches fed quantized-dequantized
rows. The reference is fed the same chunks as the pages.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import cache.quantized_pool
from blockmgr.errors import InvalidArgument
from cache import KVFormat, PagedCache, QuantizedPagePool
from cache.layers import LayerKind, LayerSpec
from tests.quant_models import (
    VOCAB,
    built,
    fake_quant_caches,
    group_size,
    num_slots,
    quantized_caches,
    reference_caches,
    run_chunks,
)

TOL = 1e-4
ALL = ["llama", "sliding", "qwen3", "gemma3", "gpt_oss", "lfm2", "qwen3_next"]


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def fmt_of(name, key_bits, value_bits):
    return KVFormat(key_bits, value_bits, group_size(name))


def paged(name, fmt, num_blocks=96, block_size=8, **kwargs):
    return PagedCache.for_model(built(name), num_blocks, block_size, kv_format=fmt,
                                num_slots=num_slots(name), **kwargs)


def close(got, want, tol=TOL):
    diff = mx.abs(mx.array(got).astype(mx.float32) - mx.array(want).astype(mx.float32))
    assert diff.max().item() < tol, diff.max().item()


def forward(pc, model, ids, rows, num_new=None):
    """One forward of right-padded `rows` for `ids` through `pc.step`."""
    width = max(map(len, rows))
    x = mx.array([r + [0] * (width - len(r)) for r in rows])
    with pc.step(ids, num_new=num_new) as views:
        out = model(x, cache=views)
        mx.eval(out)
    return out


def decode(pc, model, seq, toks):
    out = []
    for t in toks:
        pc.append(seq, [t])
        out.append(forward(pc, model, [seq], [[t]])[0])
    return mx.concatenate(out)


FORMATS = [(8, 8), (4, 4), (8, 4), (None, 4)]  # None: keys at the model's dtype


@pytest.mark.parametrize("bits", FORMATS, ids=lambda b: f"k{b[0] or 'full'}v{b[1]}")
@pytest.mark.parametrize("name", ALL)
def test_chunked_prefill_then_decode_equals_the_reference(name, bits):
    model = built(name)
    fmt = fmt_of(name, *bits)
    seq = tokens(52, 1)
    chunks = [seq[:13], seq[13:30], seq[30:40]] + [[t] for t in seq[40:]]
    want = run_chunks(model, reference_caches(model, fmt, name), chunks)
    pc = paged(name, fmt)
    pc.allocate("a", seq[:40])
    got = [forward(pc, model, ["a"], [c])[0] for c in chunks[:3]]
    got.append(decode(pc, model, "a", seq[40:]))
    close(mx.concatenate(got), want)
    if name in ("sliding", "gemma3"):  # the window released its first pages
        sliding = next(i for i, s in enumerate(pc.specs) if s.window is not None)
        assert pc.block_table("a", pc.group_of(sliding))[0] is None
    pc.check_integrity()


def test_quantized_kv_cache_and_dequantize_then_attend_agree():
    """The two references are the same computation (quantized matmuls vs
    dequantized rows and the fused kernel), so either can stand for the
    other where mlx-lm's cannot run."""
    model = built("gemma3")
    seq = tokens(40, 2)
    chunks = [seq[:25]] + [[t] for t in seq[25:]]
    for bits in (8, 4):
        a = run_chunks(model, quantized_caches(model, bits, 32), chunks)
        b = run_chunks(model, fake_quant_caches(model, KVFormat(bits, bits, 32)), chunks)
        close(a, b)


@pytest.mark.parametrize("bits", [(8, 8), (4, 4)], ids=["k8v8", "k4v4"])
@pytest.mark.parametrize("name", ["llama", "sliding", "gemma3", "gpt_oss", "lfm2", "qwen3_next"])
def test_ragged_prefill_and_batched_decode_equal_each_row_alone(name, bits):
    model = built(name)
    fmt = fmt_of(name, *bits)
    lengths = [5, 17, 33, 8, 26, 1, 29, 12]
    prompts = [tokens(n, 10 + i) for i, n in enumerate(lengths)]
    steps = [tokens(5, 30 + i) for i in range(len(lengths))]
    ids = [f"s{i}" for i in range(len(lengths))]
    pc = paged(name, fmt, num_blocks=160)
    refs = [reference_caches(model, fmt, name) for _ in ids]
    for sid, p in zip(ids, prompts):
        pc.allocate(sid, p)
    # one ragged prefill: 10 tokens of each row at most, then the rest
    first = [p[:10] for p in prompts]
    out = forward(pc, model, ids, first, num_new=[len(f) for f in first])
    for b, (f, ref) in enumerate(zip(first, refs)):
        close(out[b, : len(f)], model(mx.array([f]), cache=ref)[0])
    rest = [(sid, p[10:], ref) for sid, p, ref in zip(ids, prompts, refs) if len(p) > 10]
    out = forward(pc, model, [r[0] for r in rest], [r[1] for r in rest],
                  num_new=[len(r[1]) for r in rest])
    for b, (_, r, ref) in enumerate(rest):
        close(out[b, : len(r)], model(mx.array([r]), cache=ref)[0])
    for k in range(5):
        for sid, s in zip(ids, steps):
            pc.append(sid, [s[k]])
        out = forward(pc, model, ids, [[s[k]] for s in steps])
        for b, (s, ref) in enumerate(zip(steps, refs)):
            close(out[b, 0], model(mx.array([[s[k]]]), cache=ref)[0, 0])
    pc.check_integrity()


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (8, 4)], ids=["k8v8", "k4v4", "k8v4"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "sliding", "lfm2"])
def test_prefix_hit_equals_recomputing_the_prefix(name, bits):
    """A prompt sharing a freed sequence's prefix (ending mid-page: the
    partly matched page is copied) reuses the quantized pages; its logits
    equal the same prompt computed from scratch on pages and on the
    reference."""
    model = built(name)
    fmt = fmt_of(name, *bits)
    prefix = tokens(45, 3)
    first, second = prefix + tokens(11, 4), prefix + tokens(9, 5)
    pc = paged(name, fmt)
    pc.allocate("a", first)
    chunks = [first[:20], first[20:45], first[45:]]
    for c in chunks:
        forward(pc, model, ["a"], [c])
        pc.cache_prefix("a")  # a hybrid model snapshots at chunk ends
    pc.free("a")
    alloc = pc.allocate("b", second)
    hit = alloc.num_cached_tokens
    assert hit >= 20 if name == "lfm2" else hit == 45
    got = forward(pc, model, ["b"], [second[hit:]])[0]
    fresh = paged(name, fmt, enable_prefix_cache=False)
    fresh.allocate("c", second)
    ref_chunks = [c for c in (second[:20], second[20:45]) if c] if hit == 45 else [second[:20]]
    for c in ref_chunks:
        forward(fresh, model, ["c"], [c])
    recomputed = forward(fresh, model, ["c"], [second[hit:]])[0]
    close(got, recomputed)
    ref = reference_caches(model, fmt, name)
    run_chunks(model, ref, ref_chunks)
    close(got, model(mx.array([second[hit:]]), cache=ref)[0])
    pc.check_integrity()


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_next"])
def test_fork_copies_the_shared_last_page_on_write(name):
    model = built(name)
    fmt = fmt_of(name, 4, 4)
    prompt = tokens(45, 6)  # ends mid-page
    pc = paged(name, fmt)
    pc.allocate("a", prompt)
    forward(pc, model, ["a"], [prompt])
    pc.fork("a", "b")
    cont_a, cont_b = tokens(6, 7), tokens(6, 8)
    got_a, got_b = decode(pc, model, "a", cont_a), decode(pc, model, "b", cont_b)
    for cont, got in ((cont_a, got_a), (cont_b, got_b)):
        want = run_chunks(model, reference_caches(model, fmt, name),
                          [prompt] + [[t] for t in cont])[45:]
        close(got, want)
    assert pc.block_table("a")[5] != pc.block_table("b")[5]
    pc.check_integrity()


@pytest.mark.parametrize("name", ["llama", "sliding"])
def test_speculation_rollback_then_continue(name):
    """Drafts written and trimmed (mlx-lm's trim path), then truncated by
    the store: the rows past the cut are written again by new tokens."""
    model = built(name)
    fmt = fmt_of(name, 8, 4)
    prompt, drafts, nxt = tokens(37, 50), tokens(4, 51), tokens(3, 52)
    pc = paged(name, fmt)
    pc.allocate("a", prompt)
    forward(pc, model, ["a"], [prompt])
    pc.append("a", drafts)
    views = pc.views(["a"])
    model(mx.array([drafts]), cache=views)
    assert [v.trim(3) for v in views] == [3] * len(views)
    got = decode(pc, model, "a", nxt)
    ref = reference_caches(model, fmt, name)
    want = run_chunks(model, ref, [prompt, drafts[:1]] + [[t] for t in nxt])[-3:]
    close(got, want)
    pc.truncate("a", len(prompt))
    ref = reference_caches(model, fmt, name)
    run_chunks(model, ref, [prompt])
    close(decode(pc, model, "a", drafts[1:3]), run_chunks(model, ref, [[t] for t in drafts[1:3]]))


def test_sinks_attend_over_dequantized_pages():
    """gpt-oss's attention sinks: mlx-lm's quantized attention refuses them,
    pages serve them through the dequantized history."""
    model = built("gpt_oss")
    with pytest.raises(ValueError, match="sinks"):
        run_chunks(model, quantized_caches(model, 8, 32), [tokens(5, 9)])
    fmt = fmt_of("gpt_oss", 8, 8)
    seq = tokens(30, 9)
    pc = paged("gpt_oss", fmt)
    pc.allocate("a", seq[:24])
    got = mx.concatenate([forward(pc, model, ["a"], [seq[:24]])[0],
                          decode(pc, model, "a", seq[24:])])
    want = run_chunks(model, fake_quant_caches(model, fmt), [seq[:24]] + [[t] for t in seq[24:]])
    close(got, want)


# --- attention kernels: quantized matmuls where they pay ------------------------


@pytest.fixture
def count_quantized(monkeypatch):
    calls = {"sdpa": 0, "paged": 0}
    real_sdpa = cache.quantized_pool.quantized_sdpa
    real_paged = cache.quantized_pool.paged_quantized_attention

    def sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    def paged_(*args, **kwargs):
        calls["paged"] += 1
        return real_paged(*args, **kwargs)

    monkeypatch.setattr(cache.quantized_pool, "quantized_sdpa", sdpa)
    monkeypatch.setattr(cache.quantized_pool, "paged_quantized_attention", paged_)
    return calls


@pytest.mark.parametrize("name", ["llama", "sliding"])
def test_decode_uses_quantized_matmuls_and_equals_the_dequantized_path(name, count_quantized):
    model = built(name)
    fmt = fmt_of(name, 8, 4)
    prompts = [tokens(n, n) for n in (5, 22, 9, 30)]  # prefills: dequantized history
    outs = []
    for paged_attention in (True, False):
        pc = paged(name, fmt, paged_attention=paged_attention)
        for i, p in enumerate(prompts):
            pc.allocate(i, p)
            forward(pc, model, [i], [p])
        single = decode(pc, model, 0, [4, 5])  # one row
        pc.append(1, [6])
        pc.append(2, [7])
        batched = forward(pc, model, [1, 2], [[6], [7]])
        outs.append((single, batched))
    layers = len(model.layers)
    assert count_quantized == {"sdpa": 2 * layers, "paged": layers}  # the first run only
    close(outs[0][0], outs[1][0], 1e-5)
    close(outs[0][1], outs[1][1], 1e-5)


def test_prefill_chunks_attend_over_the_dequantized_history(count_quantized):
    model = built("llama")
    pc = paged("llama", fmt_of("llama", 8, 8))
    pc.allocate("a", tokens(30, 1))
    forward(pc, model, ["a"], [tokens(30, 1)])
    assert count_quantized == {"sdpa": 0, "paged": 0}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_quantized_pages(dtype):
    """mx.quantize keeps scales in the model's dtype: pages of a float16 or
    bfloat16 model equal mlx-lm's quantized cache at that precision."""
    from tests.quant_models import BUILDERS

    model = BUILDERS["llama"]()
    model.set_dtype(dtype)
    seq = tokens(30, 12)
    chunks = [seq[:20]] + [[t] for t in seq[20:]]
    want = run_chunks(model, quantized_caches(model, 8, 32), chunks)
    pc = PagedCache.for_model(model, 32, 8, kv_bits=8, kv_group_size=32)
    pc.allocate("a", seq[:20])
    got = mx.concatenate([forward(pc, model, ["a"], [seq[:20]])[0],
                          decode(pc, model, "a", seq[20:])])
    assert pc.views(["a"])[0].state[1].dtype == dtype  # the scales
    close(got, want, 5e-2)


# --- sizes -----------------------------------------------------------------------


def test_page_bytes_count_packed_values_scales_and_biases():
    model = built("llama")  # 2 layers, 2 kv heads of 32
    for fmt, per_row in ((KVFormat(), 32 * 4),
                         (KVFormat(8, 8, 32), 32 + 2 * 4),
                         (KVFormat(4, 4, 32), 16 + 2 * 4),
                         (KVFormat(8, 4, 32), None)):
        pc = PagedCache.for_model(model, 20, 8, kv_format=fmt)
        pc.allocate("a", tokens(19, 1))
        forward(pc, model, ["a"], [tokens(19, 1)])
        page = fmt.page_nbytes(8, 2, 32, 32, mx.float32.size)
        if per_row is not None:
            assert page == 8 * 2 * 2 * per_row
        else:
            assert page == 8 * 2 * ((32 + 8) + (16 + 8))
        assert pc.nbytes == 20 * 2 * page
        assert pc.kv_bytes_in_use == 3 * 2 * page
        assert pc.views(["a"])[0].nbytes == 3 * page


def test_qwen3_0_6b_page_ratios():
    """float16, head size 128, groups of 64 (the issue's figures)."""
    def ratio(fmt):
        return fmt.page_nbytes(16, 8, 128, 128, mx.float16.size) / KVFormat().page_nbytes(
            16, 8, 128, 128, mx.float16.size)

    assert ratio(KVFormat(8, 8)) == 136 / 256  # 0.53
    assert ratio(KVFormat(4, 4)) == 72 / 256  # 0.28
    assert ratio(KVFormat(8, 4)) == (136 + 72) / 512


# --- refusals --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"kv_bits": 3}, {"kv_bits": 16}, {"kv_bits": True}, {"kv_bits": 8, "kv_group_size": 48},
    {"kv_group_size": 64}, {"kv_format": KVFormat(8, 8), "kv_bits": 8},
    {"kv_format": "k8v8"},
])
def test_bad_options_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        PagedCache([LayerSpec(LayerKind.ATTENTION)], 8, 4, **kwargs)


def test_a_head_size_the_group_does_not_divide_is_refused_naming_the_layer():
    from tests.tiny_models import tiny_llama  # head size 16

    model = tiny_llama()
    with pytest.raises(InvalidArgument, match="layer 0: key head size 16"):
        PagedCache.for_model(model, 16, 8, kv_bits=8, kv_group_size=32)
    # built without the model: refused at the first write, the step rolled back
    pc = PagedCache([LayerSpec(LayerKind.ATTENTION)] * 2, 16, 8, kv_bits=4)
    pc.allocate("a", [1, 2, 3])
    with pytest.raises(InvalidArgument, match="layer 0"):
        with pc.step(["a"]) as views:
            model(mx.array([[1, 2, 3]]), cache=views)
    assert pc.num_computed("a") == 0 and pc.nbytes == 0
    pc.check_integrity()


def test_unquantized_side_and_index_cache_width():
    """A side kept at the model's dtype (bits None) and a side of width 0
    store what they should; the pool reads back quantized rows exactly."""
    from cache.page_pool import PoolShape

    shape = PoolShape(4, 2, 1, 64, 0, mx.float32)
    pool = QuantizedPagePool(shape, 8, 4, 32)
    assert len(pool.arrays()) == 3  # the keys' packed values, scales, biases
    rows, cols = mx.array([1, 2]), mx.array([0, 1])
    k = mx.random.normal((2, 64))
    pool.write(rows, cols, k, mx.zeros((2, 0)))
    got_k, got_v = pool.read_tokens(rows, cols)
    want = mx.dequantize(*mx.quantize(k, group_size=32, bits=8), group_size=32, bits=8)
    assert mx.array_equal(got_k, want).item() and got_v.shape == (2, 0)
    mixed = QuantizedPagePool(PoolShape(4, 2, 1, 64, 64, mx.float32), None, 4, 32)
    mixed.write(rows, cols, k, k)
    got_k, got_v = mixed.read_tokens(rows, cols)
    assert mx.array_equal(got_k, k).item()
    assert mx.array_equal(got_v, mx.dequantize(*mx.quantize(k, group_size=32, bits=4),
                                               group_size=32, bits=4)).item()
