"""Whether a model's own mlx-lm code computes batched rows right.

The paged views give every model the same batch layout (right-padded rows,
per-row offsets, explicit masks), but some mlx-lm model files cannot use it:
gemma2's mask does not broadcast over its 5-D grouped scores (wrong with two
rows, an error with three), gpt_bigcode reads ``cache.offset`` as one Python
int, the SSM layers of jamba / nemotron_h / olmo_hybrid / bailing_moe_linear /
mamba run their state through a row's right padding, afm7's KV-reuse layers
place queries at the padded history length. mlx-lm's own batching is wrong
there too.

A few models compute a batch wrong only on inputs far longer than a probe
can afford; `DECLARED` lists them by mlx-lm module with the reason, and
`probe_batching` returns that entry without running anything.

`probe_batching` finds out by running a few tokens both ways on the engine's
own storage, so the engine can run the affected rows one by one and keep its
outputs right (`BatchSupport`). Nothing of the probe stays in the storage:
its sequences are freed with no computed token (none enters the prefix trie).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from blockmgr.errors import UnknownSequence
from cache import PagedCache
from scheduler.engine.runner import right_padded

#: Prompts of the probe: three rows of different lengths (a third row
#: catches models that break only beyond two), token ids every vocabulary has.
PROBE_PROMPTS = ([1, 2, 3], [4, 5, 6, 7, 8, 9], [3, 1, 4, 1])
PROBE_NEXT = 2  # the decode token every row feeds after its prompt
_PROBE_ID = "__batch_probe__"


@dataclass(frozen=True, slots=True)
class BatchSupport:
    """What may share a forward: `decode` rows (one token each), ragged
    `prefill` chunks; `reason` says why something runs one row at a time."""

    decode: bool = True
    prefill: bool = True
    reason: str | None = None


#: Models whose batching breaks only beyond what a short probe reaches, by
#: mlx-lm module. minimax_m3_vl's sparse layers place a step's queries at
#: (history width - new tokens) and cut key blocks at multiples of the block
#: size over the history's slots: one width for all rows, so rows at other
#: offsets (padded, or left-padded as mlx-lm's own BatchKVCache does) select
#: other key blocks. It only shows once a row has more than
#: index_topk_blocks * index_block_size keys (thousands in real configs).
DECLARED: dict[str, BatchSupport] = {
    "mlx_lm.models.minimax_m3_vl": BatchSupport(
        decode=False, prefill=False,
        reason="minimax_m3_vl's sparse layers take query positions and key-block bounds "
               "from the batch's history width, one for all rows (declared)"),
}


def declared_support(model: Any) -> BatchSupport | None:
    """The `DECLARED` entry of `model`'s mlx-lm module, or None."""
    return DECLARED.get(type(model).__module__)


def tolerance(dtype: mx.Dtype) -> float:
    """Relative logit difference above which batched rows count as wrong:
    far above rounding (batched and single matmuls round differently), far
    below the O(1) errors of a broken layout."""
    return 1e-4 if dtype == mx.float32 else 2e-2


def probe_batching(model: Any, cache: Any, probe_prefill: bool = True) -> BatchSupport:
    """Run the probe prompts alone and batched on `cache` and compare logits.

    `cache`: a `PagedCache` for `model` with room for the three probe rows
    (`probe_cache` builds one; the engine never probes its own storage, so
    the probe cannot touch its prefix trie or statistics). Decode: prompts
    prefilled alone, then one batched decode step. Prefill (when
    `probe_prefill`): one ragged batched prefill, then each row decoded
    alone (a layer that runs state through padding is wrong only after it).
    An error in a batched forward counts as unsupported; an error in a
    single-row forward propagates (the model cannot run at all). Cost: 13
    forwards of at most 6 tokens; none for a model `DECLARED` unbatchable.
    """
    if (declared := declared_support(model)) is not None:
        return declared
    alone = np.stack([np.stack(_run_alone(model, cache, p)) for p in PROBE_PROMPTS])
    tol = tolerance(_param_dtype(model))
    decode_error = _batched_error(cache, lambda: _decode_batched(model, cache),
                                  alone[:, 1], tol)
    prefill_error = None
    if probe_prefill:
        prefill_error = _batched_error(cache, lambda: _prefill_batched(model, cache), alone, tol)
    reasons = [f"{what}: {err}" for what, err in (("batched decode", decode_error),
                                                  ("batched prefill", prefill_error)) if err]
    return BatchSupport(decode_error is None, prefill_error is None,
                        "; ".join(reasons) or None)


def probe_cache(model: Any, block_size: int, hybrid: bool):
    """Private storage for the probe: room for its rows, nothing else."""
    pages_per_row = -(-(max(map(len, PROBE_PROMPTS)) + 1) // block_size)
    rows = len(PROBE_PROMPTS)
    return PagedCache.for_model(model, num_blocks=rows * pages_per_row + 2, block_size=block_size,
                                num_slots=2 * rows if hybrid else 0, enable_prefix_cache=False)


def _ids() -> list[str]:
    return [f"{_PROBE_ID}{i}" for i in range(len(PROBE_PROMPTS))]


def _forward(model, cache, ids, rows, num_new=None) -> np.ndarray:
    logits = model(right_padded(rows), cache=cache.views(ids, num_new=num_new))
    return np.array(logits.astype(mx.float32))


def _run_alone(model, cache, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(last prompt logits, decode logits) of `prompt` alone."""
    sid = _ids()[0]
    cache.allocate(sid, prompt)
    try:
        last = _forward(model, cache, [sid], [prompt])[0, -1]
        cache.append(sid, [PROBE_NEXT])
        step = _forward(model, cache, [sid], [[PROBE_NEXT]])[0, -1]
    finally:
        cache.free(sid, num_computed=0)
    return last, step


def _decode_batched(model, cache) -> np.ndarray:
    ids = _ids()
    for sid, p in zip(ids, PROBE_PROMPTS):
        cache.allocate(sid, p)
        _forward(model, cache, [sid], [p])
        cache.append(sid, [PROBE_NEXT])
    return _forward(model, cache, ids, [[PROBE_NEXT]] * len(ids))[:, 0]


def _prefill_batched(model, cache) -> np.ndarray:
    """[rows, 2, vocab]: each row's last prompt logits from one ragged
    batched prefill, then its decode logits alone."""
    ids = _ids()
    for sid, p in zip(ids, PROBE_PROMPTS):
        cache.allocate(sid, p)
    lengths = [len(p) for p in PROBE_PROMPTS]
    logits = _forward(model, cache, ids, list(PROBE_PROMPTS), num_new=lengths)
    out = []
    for b, sid in enumerate(ids):
        cache.append(sid, [PROBE_NEXT])
        step = _forward(model, cache, [sid], [[PROBE_NEXT]])[0, -1]
        out.append(np.stack([logits[b, lengths[b] - 1], step]))
    return np.stack(out)


def _batched_error(cache, run, want: np.ndarray, tol: float) -> str | None:
    """None when `run()` gives `want` within `tol` (relative), else what went
    wrong. The probe's sequences are freed either way."""
    try:
        got = run()
    except Exception as e:  # the model's own code cannot take the batch
        return f"{type(e).__name__}: {e}"
    finally:
        for sid in _ids():
            try:
                cache.free(sid, num_computed=0)
            except UnknownSequence:  # not allocated before the failure
                pass
    scale = max(1.0, float(np.abs(want).max()))
    worst = float(np.abs(got - want).max()) if np.all(np.isfinite(got)) else float("inf")
    if worst > tol * scale:
        return f"logits differ from single rows by {worst:.3g}"
    return None


def _param_dtype(model) -> mx.Dtype:
    """The dtype of the model's first floating-point weight (float32 if none)."""
    # without a destination, tree_flatten gives a list of (key, array) pairs
    for _, value in cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32
