"""Every mlx-lm architecture on paged storage, against mlx-lm's own caches.

The architectures are discovered from ``mlx_lm.models`` (`arch_models`), so
a new mlx-lm release is swept without editing this file; each is built as a
tiny random-weight model and run through the checks of `arch_checks`
(single prefill + decode, batched decode, ragged batched prefill, reuse of a
42-token prefix, `Engine.generate` vs `generate_step`).

By default a quick subset runs (one architecture per family of layer kinds
and per fixed gap); ``BLOCKMGR_ARCH_SWEEP=full`` runs every architecture
(about a minute on 2 cores; `.ci/run` sets it). Exceptions are listed with
their reasons in `arch_status` and are strict: a check that starts passing
fails until its entry is removed.
"""

from __future__ import annotations

import functools
import gc
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache

from blockmgr.errors import InvalidArgument
from cache import LayerKind, PagedCache, layer_specs
from scheduler import Engine, SamplingParams
from scheduler.engine.batch_probe import BatchSupport, declared_support, probe_batching, probe_cache
from tests.arch_checks import CHECKS, close, forward, reference, tokens
from tests.arch_models import architectures, build
from tests.arch_status import (
    MLX_LM_LIMITS,
    PROJECT_GAPS,
    UNBUILDABLE,
    expected_failure,
)
from tests.reference import greedy_reference

FULL = os.environ.get("BLOCKMGR_ARCH_SWEEP") == "full"

#: The default subset: full attention, MLA, sliding windows, every recurrent
#: family, and each architecture a closed gap was found on.
QUICK = ("llama", "deepseek_v3", "gemma3_text", "plamo3", "lfm2", "qwen3_next", "mamba",
         "rwkv7", "kimi_linear", "afm7", "gemma3n", "gemma2", "jamba", "granitemoehybrid",
         "falcon_h1", "longcat_flash", "llama4", "deepseek_v32", "minimax_m3_vl",
         "longcat_flash_ngram", "deepseek_v41")


def _cases():
    names = architectures() if FULL else [n for n in architectures() if n in QUICK]
    for name in names:
        marks = [] if name in QUICK else [pytest.mark.slow]
        for check in CHECKS:
            yield pytest.param(name, check, id=f"{name}-{check}", marks=marks)


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return build(name)


def test_quick_subset_is_discovered():
    """Every quick architecture is still shipped by mlx-lm (a rename would
    silently shrink the default sweep)."""
    assert set(QUICK) <= set(architectures())


def test_every_listed_exception_names_a_discovered_architecture():
    known = set(architectures())
    assert set(UNBUILDABLE) <= known
    assert set(PROJECT_GAPS) <= known
    assert {name for name, _ in MLX_LM_LIMITS} <= known
    assert all(check in CHECKS for _, check in MLX_LM_LIMITS)


@pytest.mark.parametrize("name, check", list(_cases()))
def test_architecture(name, check):
    if name in UNBUILDABLE:
        pytest.skip(UNBUILDABLE[name])
    model = _model(name)
    reason = expected_failure(name, check, model)
    if reason is None:
        CHECKS[check](model)
        return
    try:
        CHECKS[check](model)
    except Exception as e:  # the listed limitation or gap, in any form
        pytest.xfail(f"{reason} ({type(e).__name__}: {e})")
    pytest.fail(f"{name} {check} passes now: remove its entry ({reason})")


# --- the closed gaps, one focused test each (the sweep covers them too) ------


def test_attention_only_model_ignores_slots():
    """`for_model(attention_only, num_slots=4)` builds no slot bookkeeping
    (nothing would hold the state) and runs like num_slots=0."""
    model = _model("llama")
    pc = PagedCache.for_model(model, num_blocks=16, block_size=8, num_slots=4)
    assert pc.recurrent is None and pc.block_manager.config.num_slots == 0
    prompt = tokens(21, 9)
    pc.allocate("a", prompt)
    close(forward(model, pc, ["a"], [prompt])[0], reference(model, prompt, [9]), "prefill")
    pc.check_integrity()


@pytest.mark.parametrize("name, decode, prefill", [
    ("llama", True, True), ("qwen3_next", True, True),
    ("gemma2", False, False), ("jamba", True, False), ("mamba", True, False),
    ("deepseek_v41", False, False),
])
def test_batch_probe_finds_what_mlx_lm_cannot_batch(name, decode, prefill):
    """The probe agrees with the sweep's batched checks on these models."""
    model = _model(name)
    hybrid = any(s.kind is LayerKind.RECURRENT for s in layer_specs(model))
    support = probe_batching(model, probe_cache(model, 8, hybrid))
    assert (support.decode, support.prefill) == (decode, prefill), support.reason
    assert (support.reason is None) == (decode and prefill)


def test_engine_without_probe_batches_rows_mlx_lm_computes_wrong():
    """Why the probe exists: gemma2's batched decode is wrong without it
    (the sweep's engine check passes with it). With 3 rows mlx-lm's mask
    does not even broadcast: the forward raises, and the engine's fault
    handling (rolled back, the rows run alone) still gives mlx-lm's output.
    With 2 rows the batched logits are silently wrong (the sweep's
    batched_decode check), which only the probe catches."""
    model = _model("gemma2")
    prompts = [tokens(14, 5), tokens(15, 11), tokens(16, 19)]
    want = [greedy_reference(model, p, 2) for p in prompts]
    engine = Engine(model, num_blocks=64, block_size=8, batch_probe=False)
    assert engine.batching == BatchSupport()
    outs = engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.stats.num_forward_errors >= 1
    assert [o.tokens for o in outs] == want


def test_declared_unbatchable_model_is_wrong_batched_even_on_mlx_lm():
    """Why minimax_m3_vl is declared (`batch_probe.DECLARED`) rather than
    probed: batched, its sparse layers select other key blocks on mlx-lm's
    own left-padded `BatchKVCache` (a padding of 7, not a multiple of the
    block size 4), and in an engine that batches it; the probe's short
    prompts never reach the block selection. With the declaration the
    engine's rows run alone (the sweep's engine check)."""
    model = _model("minimax_m3_vl")
    assert declared_support(model) == BatchSupport(False, False, declared_support(model).reason)
    prompts = [tokens(3, 14), tokens(4, 21)]
    pads = [7, 0]
    caches = [CacheList(*(BatchKVCache(left_padding=pads) for _ in c.caches))
              for c in model.make_cache()]
    batch = mx.array([[0] * p + t for p, t in zip(pads, prompts)])
    last = np.array(model(batch, cache=caches)[:, -1])
    worst = [float(np.abs(last[b] - reference(model, p, [len(p)])[-1]).max())
             for b, p in enumerate(prompts)]
    assert worst[1] < 1e-4 < worst[0], worst
    prompts = [tokens(14, 5), tokens(15, 11), tokens(16, 19)]
    engine = Engine(model, num_blocks=64, block_size=8, prefill_batch=3, batch_probe=False)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.tokens for o in outs] != [greedy_reference(model, p, 4) for p in prompts]


@pytest.mark.parametrize("keep_fetched", [True, False])
def test_keys_and_values_is_the_fetched_history(keep_fetched):
    """`keys_and_values()` after a step equals mlx-lm's `KVCache` history,
    whether the model still holds what `update_and_fetch` returned or not
    (then it is re-gathered from the pages)."""
    rng = np.random.default_rng(0)
    pc = PagedCache(layer_specs(_model("llama"))[:1], num_blocks=8, block_size=4)
    ref = KVCache()
    pc.allocate("a", list(range(7)))
    for n in (5, 2):
        views = pc.views(["a"])
        k, v = (mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32)) for _ in "kv")
        views[0].make_mask(n)
        fetched = views[0].update_and_fetch(k, v)
        ref.update_and_fetch(k, v)
        if not keep_fetched:
            del fetched
            gc.collect()
        for got, want in zip(views[0].keys_and_values(), ref.keys_and_values()):
            np.testing.assert_array_equal(np.array(got), np.array(want))


def test_maskless_model_needs_reserved_tokens_and_a_refusal_changes_nothing():
    """mamba never tells its cache its input width: a forward with nothing
    reserved is refused (typed error, storage unchanged); the same forward
    after `append` matches mlx-lm."""
    model = _model("mamba")
    pc = PagedCache.for_model(model, num_blocks=16, block_size=8, num_slots=4)
    prompt, nxt = tokens(22, 7), tokens(23, 1)
    pc.allocate("a", prompt)
    forward(model, pc, ["a"], [prompt])
    with pytest.raises(InvalidArgument):
        model(mx.array([nxt]), cache=pc.views(["a"]))
    assert (pc.num_tokens("a"), pc.num_computed("a")) == (7, 7)
    pc.check_integrity()
    pc.append("a", nxt)
    got = forward(model, pc, ["a"], [nxt])[0]
    close(got, reference(model, prompt + nxt, [7])[7:], "decode after the refusal")


def test_token_context_needs_reserved_tokens_and_a_refusal_changes_nothing():
    """longcat_flash_ngram reads its n-gram context from the sequence's token
    ids: a forward over tokens nobody reserved (ids unknown) is refused
    (typed error, storage unchanged); the same forward after `append`
    matches mlx-lm."""
    model = _model("longcat_flash_ngram")
    pc = PagedCache.for_model(model, num_blocks=16, block_size=8)
    assert pc.recurrent is None  # the context needs no slot
    prompt, nxt = tokens(22, 7), tokens(23, 1)
    pc.allocate("a", prompt)
    forward(model, pc, ["a"], [prompt])
    assert pc.num_computed("a") == 7  # the step counts as finished from here
    before = pc.debug_state()
    with pytest.raises(InvalidArgument):
        model(mx.array([nxt]), cache=pc.views(["a"]))
    assert pc.debug_state() == before
    pc.check_integrity()
    pc.append("a", nxt)
    got = forward(model, pc, ["a"], [nxt])[0]
    close(got, reference(model, prompt + nxt, [7])[7:], "decode after the refusal")


def test_token_context_follows_truncate_and_fork():
    """The context is the sequence's own ids, so a rollback (`truncate`) and
    a fork continue exactly as mlx-lm on the kept tokens."""
    model = _model("longcat_flash_ngram")
    pc = PagedCache.for_model(model, num_blocks=32, block_size=8)
    prompt, drafted, kept = tokens(24, 10), tokens(25, 3), tokens(26, 2)
    pc.allocate("a", prompt + drafted)
    forward(model, pc, ["a"], [prompt + drafted])
    pc.truncate("a", len(prompt))
    pc.fork("a", "b")
    for sid in ("a", "b"):
        pc.append(sid, kept)
    got = forward(model, pc, ["a", "b"], [kept, kept])
    want = reference(model, prompt + kept, [len(prompt)])[len(prompt):]
    for b in range(2):
        close(got[b], want, f"row {b} after truncate")
    pc.check_integrity()


def test_compressed_layer_cache_refuses_a_batch_and_changes_nothing():
    """deepseek_v41's layer cache serves one row per forward (mlx-lm's model
    takes one start position): two rows raise a typed error inside a `step`,
    which rolls back (nothing computed, the slots as they were); each row
    then runs alone exactly as on mlx-lm's `LayerCache`."""
    model = _model("deepseek_v41")
    pc = PagedCache.for_model(model, num_blocks=32, block_size=8, num_slots=4)
    prompts = [tokens(27, 9), tokens(28, 14)]
    for sid, p in zip("ab", prompts):
        pc.allocate(sid, p)
    before = pc.debug_state()
    with pytest.raises(InvalidArgument):
        with pc.step(["a", "b"], num_new=[9, 14]) as views:
            model(mx.array([p + [0] * (14 - len(p)) for p in prompts]), cache=views)
    assert pc.debug_state() == before
    for sid, p in zip("ab", prompts):
        close(forward(model, pc, [sid], [p])[0], reference(model, p, [len(p)]), f"{sid} alone")
    pc.check_integrity()


def test_compressed_layer_cache_state_matches_mlx_lm():
    """What deepseek_v41 reads of its layer caches at a step's start (the
    window rows, the open group, the entries and index keys so far) equals
    mlx-lm's `LayerCache` after the same tokens, read from the pages and
    the slot (the logit checks see only the window's width)."""
    model = _model("deepseek_v41")
    prompt, nxt = tokens(29, 23), tokens(30, 1)
    ref = model.make_cache()
    model(mx.array([prompt]), cache=ref)
    pc = PagedCache.for_model(model, num_blocks=32, block_size=8, num_slots=4)
    pc.allocate("a", prompt)
    forward(model, pc, ["a"], [prompt])
    pc.append("a", nxt)
    views = pc.views(["a"])
    for layer, (view, want) in enumerate(zip(views, ref)):
        got = [view.window]
        names = ["window"]
        if layer in (1, 3):  # the compressing layers
            names += ["compress_kv", "index_k", "pending_kv", "pending_gate"]
            got += [view.compress_kv, view.index_k, view.pending_kv, view.pending_gate]
        for name, g in zip(names, got):
            w = getattr(want, name)
            assert g.shape == w.shape, (layer, name, g.shape, w.shape)
            np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-6,
                                       err_msg=f"{layer} {name}")
    got = np.array(model(mx.array([nxt]), cache=views))[0]
    close(got, reference(model, prompt + nxt, [len(prompt)])[-1:], "decode after the reads")
