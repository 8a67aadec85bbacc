"""Hypothesis state machines over the declared layer caches, against mlx-lm.

deepseek_v41 (`CompressedLayer`: window, entries at group-closing tokens,
the open group in a slot) and longcat_flash_ngram (`TokenContextView`: the
last n - 1 ids) keep state whose boundaries (groups of `ratio` tokens,
pages, windows, chunk ends) the sweep's fixed prompts cross only at a few
places. Here sequences are prefilled in random chunks, decoded, checkpointed,
freed and reused at random points; every forward's logits are compared with
the same model on mlx-lm's own caches fed the same chunks (the shadow), and
`check_integrity()` runs after every rule. A rule sends refused calls (a
batch to deepseek_v41, a forward over unreserved tokens) and asserts that
nothing changed.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockmgr.errors import InvalidArgument, OutOfSlots
from cache import PagedCache
from tests.arch_checks import TOL
from tests.arch_models import VOCAB, build

BLOCK = 4  # pages of 4 tokens: page, group (ratio 4) and window (12) boundaries all near


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return build(name)


class DeclaredCacheMachine(RuleBasedStateMachine):
    name = ""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model(self.name)
        self.pc = PagedCache.for_model(self.model, num_blocks=64, block_size=BLOCK, num_slots=12)
        self.live: dict[str, tuple[list[int], int, list]] = {}  # id -> (tokens, fed, shadow)
        self.finished: list[list[int]] = []  # token lists of freed sequences
        self.next_id = 0

    # --- helpers --------------------------------------------------------------

    def _forward(self, sid: str, chunk: list[int]) -> None:
        """One forward of `chunk` (reserved, pending) on the pages and on the shadow."""
        tokens, fed, shadow = self.live[sid]
        with self.pc.step([sid], num_new=[len(chunk)]) as views:
            got = self.model(mx.array([chunk]), cache=views)
        want = self.model(mx.array([chunk]), cache=shadow)
        diff = float(np.abs(np.array(got) - np.array(want)).max())
        assert diff <= TOL, f"{sid}: tokens {fed}..{fed + len(chunk)}: |diff| {diff:.3g}"
        self.live[sid] = (tokens, fed + len(chunk), shadow)

    def _start(self, tokens: list[int]) -> None:
        if not self.pc.can_allocate(tokens):
            return
        sid = f"s{self.next_id}"
        self.next_id += 1
        alloc = self.pc.allocate(sid, tokens)
        shadow = self.model.make_cache()
        hit = alloc.num_cached_tokens
        if hit:  # the shadow computes the reused prefix itself
            self.model(mx.array([tokens[:hit]]), cache=shadow)
        self.live[sid] = (tokens, hit, shadow)

    def _pending(self, sid: str) -> int:
        tokens, fed, _ = self.live[sid]
        return len(tokens) - fed

    # --- rules ----------------------------------------------------------------

    @precondition(lambda self: len(self.live) < 3)
    @rule(data=st.data(), n=st.integers(1, 14))
    def start(self, data, n):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        self._start(rng.integers(1, VOCAB, n).tolist())

    @precondition(lambda self: len(self.live) < 3 and self.finished)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def reuse(self, data, extra):
        """A prompt that starts with a freed sequence's tokens, cut anywhere."""
        old = data.draw(st.sampled_from(self.finished))
        cut = data.draw(st.integers(1, len(old)))
        rng = np.random.default_rng(cut)
        self._start(old[:cut] + rng.integers(1, VOCAB, extra).tolist())

    @precondition(lambda self: any(self._pending(s) for s in self.live))
    @rule(data=st.data())
    def prefill_chunk(self, data):
        sid = data.draw(st.sampled_from([s for s in self.live if self._pending(s)]))
        tokens, fed, _ = self.live[sid]
        k = data.draw(st.integers(1, len(tokens) - fed))
        self._forward(sid, tokens[fed : fed + k])

    @precondition(lambda self: any(not self._pending(s) for s in self.live))
    @rule(data=st.data(), token=st.integers(1, VOCAB - 1))
    def decode(self, data, token):
        sid = data.draw(st.sampled_from([s for s in self.live if not self._pending(s)]))
        if not self.pc.can_append(sid, 1):
            return
        tokens, fed, shadow = self.live[sid]
        self.pc.append(sid, [token])
        self.live[sid] = (tokens + [token], fed, shadow)
        self._forward(sid, [token])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def checkpoint(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        before = self.pc.debug_state()
        try:
            self.pc.cache_prefix(sid)
        except OutOfSlots:  # every slot held: the sequences' own and the snapshots on their paths
            assert self.pc.num_free_slots == 0
            assert self.pc.debug_state() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, fed, _ = self.live.pop(sid)
        self.pc.free(sid)
        if fed:
            self.finished.append(tokens[:fed])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def refused_forward(self, data):
        """Refused calls change nothing: a forward over tokens nobody reserved
        (both models read state a reservation says how to place), and for
        deepseek_v41 a batch of two rows (one start position only)."""
        ids = sorted(self.live)
        calls = [[data.draw(st.sampled_from(ids))]]
        if self.name == "deepseek_v41" and len(ids) > 1:
            calls.append(ids[:2])
        for batch in calls:
            if len(batch) == 1 and self._pending(batch[0]):
                continue  # reserved tokens: the forward would be legal
            before = self.pc.debug_state()
            try:
                with self.pc.step(batch) as views:
                    self.model(mx.array([[1]] * len(batch)), cache=views)
            except InvalidArgument:
                pass
            else:
                raise AssertionError(f"{batch}: the forward was not refused")
            assert self.pc.debug_state() == before

    @invariant()
    def integrity(self):
        self.pc.check_integrity()


class CompressedLayerMachine(DeclaredCacheMachine):
    name = "deepseek_v41"


class TokenContextMachine(DeclaredCacheMachine):
    name = "longcat_flash_ngram"


_SETTINGS = settings(max_examples=8, stateful_step_count=20, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestCompressedLayer = CompressedLayerMachine.TestCase
TestCompressedLayer.settings = _SETTINGS
TestTokenContext = TokenContextMachine.TestCase
TestTokenContext.settings = _SETTINGS
