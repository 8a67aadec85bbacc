"""Refit a cost profile's recorded steps with the current cost-model terms.

A profile keeps every measured step as its term multipliers (`steps`,
named by `step_fields`), so it can be refitted when the cost model gains a
term, without measuring again. A term the profile predates is rebuilt from
the recorded ones where that is exact: `prefill_chunk_token_square` (n^2 per
chunk) is the step's prefill tokens squared, since every calibration step
runs at most one prefill chunk; `decode_forward_overhead`'s multiplier is
computed from the decode rows and sampling chunks; the decode rows' keys
(`decode_context_tokens`) are the context less the one chunk's keys, whose
start the chunk's token pairs give. The layout is the profile's (none:
full). The knee is refitted with the rest. A step that cannot be rebuilt
(a decode row beside several chunks, recorded without its decode keys) is
left out, and counted. `--without` holds coefficients at 0: the same steps
fitted in an older form, to compare forms on one calibration.

    python benchmarks/refit_profile.py old-profile.json new-profile.json \
        [--without decode_attention_per_context_token,decode_attention_beyond_knee]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.simulator.cost_model import COEFFICIENTS, CostModel, StepShape  # noqa: E402
from scheduler.simulator.layout import ModelLayout  # noqa: E402
from scheduler.simulator.profile import (  # noqa: E402
    CostProfile,
    StepSample,
    fit_cost_model,
    format_fit,
    read_layout,
    write_profile,
)

#: CostModel field -> the StepShape field its multiplier is (None: computed).
_SHAPE_OF = {
    "step_overhead": None, "prefill_per_token": "prefill_tokens",
    "decode_per_token": "decode_rows",
    "attention_per_context_token": "context_tokens", "copy_per_page": "page_copies",
    "copy_per_slot": "slot_copies", "swap_per_page": "swaps",
    "prefill_chunk_overhead": "prefill_chunks",
    "prefill_sample_overhead": "sampled_chunks",
    "prefill_attention_per_token_pair": "prefill_token_pairs",
    "decode_batch_overhead": None, "decode_padded_context_token": None,
    "random_sample_per_row": "random_samples",
    "prefill_chunk_token_square": "prefill_token_squares",
    "decode_attention_per_context_token": "decode_context_tokens",
}


def shape_of(names: list[str], terms: list[float], label: str, layout: ModelLayout,
             knee: float = 0.0) -> StepShape:
    """The `StepShape` whose `terms(knee)` extend the recorded `terms` (`knee`:
    the profile's `decode_context_knee`)."""
    t = dict(zip(names, terms))
    values = {shape: t[name] for name, shape in _SHAPE_OF.items() if shape and name in t}
    rows = t["decode_per_token"]
    values["longest_decode_context"] = t["decode_padded_context_token"] / rows if rows else 0.0
    several = t["prefill_chunk_overhead"] > 1
    if "prefill_chunk_token_square" not in t:
        if several:
            raise ValueError(f"step {label!r} has several prefill chunks: n^2 is not recorded")
        values["prefill_token_squares"] = t["prefill_per_token"] ** 2
    if "decode_attention_per_context_token" not in t and rows:
        if several:
            raise ValueError(f"step {label!r} has several prefill chunks: "
                             "its decode keys are not recorded")
        values["decode_context_tokens"] = t["attention_per_context_token"] - _chunk_keys(t, layout)
    ints = {f.name for f in fields(StepShape) if f.type == "int"}
    shape = StepShape(**{k: int(v) if k in ints else v for k, v in values.items()})
    if list(shape.terms(knee))[:len(terms)] != list(terms):
        raise ValueError(f"step {label!r}: cannot rebuild its shape from {terms}")
    return shape


def _chunk_keys(t: dict, layout: ModelLayout) -> float:
    """The keys a step's one prefill chunk of n tokens reads at its end: its
    token pairs are n x (keys at its start + n / 2), and the keys at a
    position grow with it (bisection)."""
    n = t["prefill_per_token"]
    if not n:
        return 0.0
    at_start = t["prefill_attention_per_token_pair"] / n - n / 2
    low, high = 0, 1 << 24
    while low < high:  # the first start whose keys reach at_start
        middle = (low + high) // 2
        if layout.attended(middle) < at_start - 1e-6:
            low = middle + 1
        else:
            high = middle
    return layout.attended(low + int(n))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--without", default="", help="comma-separated coefficients held at 0")
    args = parser.parse_args()
    source, target = args.source, args.target
    without = [name for name in args.without.split(",") if name]
    unknown = sorted(set(without) - set(COEFFICIENTS))
    if unknown:
        parser.error(f"--without: not a cost coefficient: {', '.join(unknown)}")
    data = json.loads(Path(source).read_text())
    names = (data.get("step_fields")
             or [f.name for f in fields(CostModel)][:len(data["steps"][0][2])])
    layout = read_layout(source)
    knee = data["cost"].get("decode_context_knee", 0.0)
    samples, skipped = [], []
    for label, seconds, terms in data["steps"]:
        try:
            samples.append(StepSample(label, shape_of(names, terms, label, layout, knee), seconds))
        except ValueError as exc:  # a step the recorded multipliers do not pin: left out
            skipped.append(str(exc))
    if skipped:
        print(f"left out {len(skipped)} of {len(data['steps'])} steps: {skipped[0]}",
              file=sys.stderr)
    copy = data["grid"]["copy_per_page_measured_s"]
    held = {name: 0.0 for name in without}
    cost, fit = fit_cost_model(samples, {"copy_per_page": copy, "swap_per_page": copy, **held})
    grid = {**data["grid"], "refitted_from": source} | (
        {"refitted_without": without} if without else {})
    profile = CostProfile(cost, fit, data["machine"], data["model"], grid,
                          data["created"], tuple(samples), layout)
    write_profile(target, profile)
    print(format_fit(fit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
