"""Cost profiles: a `CostModel` fitted to the real engine, with how well it
fits and where it was measured, as a JSON file.

    {"type": "blockmgr-cost-profile", "version": 1,
     "cost": {CostModel fields},
     "fit": {"num_steps", "median_abs_rel_error", "mean_abs_rel_error",
             "points": [{"label", "steps", "measured_s", "predicted_s",
                         "rel_error"}, ...]},
     "machine": {...}, "mlx_version": "...", "blas": {...}, "model": {...},
     "layout": {ModelLayout}, "grid": {...}, "created": "ISO time",
     "step_fields": [CostModel coefficient names],
     "steps": [[label, seconds, [the multiplier of each coefficient]], ...]}

`blockmgr calibrate` writes one; `blockmgr simulate --profile FILE` reads it.
The layout is the calibrated model's: the context terms count the keys its
attention layers read, so the profile prices simulations of that layout (a
profile without one predates layouts and counted every key: "full").
Reading never imports MLX. Fitting (`fit_cost_model`) is a non-negative
least-squares fit of the per-step times on `StepShape.terms()`, each step's error divided by
its grid point's mean step time: short decode steps weigh as much as long
prefill steps, and within a point the fit matches the mean (timing noise on
a shared machine is skewed; a fit of per-step relative errors would
under-predict the mean). The decode keys' knee is the one of `KNEES` whose
fit has the least weighted residual.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from scheduler.simulator.cost_model import COEFFICIENTS, KNEES, CostModel, StepShape
from scheduler.simulator.json_file import read_json
from scheduler.simulator.layout import ModelLayout

PROFILE_TYPE = "blockmgr-cost-profile"
PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file cannot be used; the message names the file and field."""


@dataclass(slots=True, frozen=True)
class StepSample:
    """One measured engine step: its shape, seconds, and grid point label."""

    label: str
    shape: StepShape
    seconds: float


def fit_cost_model(samples: Sequence[StepSample], fixed: dict[str, float] | None = None):
    """(CostModel, fit dict). `fixed`: coefficients measured elsewhere (copies,
    swaps); they are subtracted before the fit and kept as given. Terms no
    sample exercises get 0 unless fixed. The knee: each of `KNEES` up to the
    most decode keys a sample has, the least residual wins.
    O(knees x samples x terms^2)."""
    fixed = dict(fixed or {})
    most = max((s.shape.decode_context_tokens for s in samples), default=0.0)
    fits = [_fit_at_knee(samples, fixed, knee) for knee in KNEES if knee < most or knee == 0.0]
    residual, coefficients, knee = min(fits, key=lambda fit: fit[0])
    values = dict(zip(COEFFICIENTS, (float(c) for c in coefficients)))
    model = CostModel(**values,
                      decode_context_knee=knee if values["decode_attention_beyond_knee"] else 0.0)
    return model, fit_report(model, samples)


def _fit_at_knee(samples: Sequence[StepSample], fixed: dict[str, float], knee: float):
    """(weighted residual norm, coefficients, knee) of the fit with `knee`."""
    terms = np.array([s.shape.terms(knee) for s in samples], dtype=np.float64)
    seconds = np.array([s.seconds for s in samples], dtype=np.float64)
    known = np.array([fixed.get(n, 0.0) for n in COEFFICIENTS])
    free = [i for i, n in enumerate(COEFFICIENTS) if n not in fixed and terms[:, i].any()]
    target = seconds - terms @ known
    weights = 1.0 / _label_means(samples)
    a, b = terms[:, free] * weights[:, None], target * weights
    solution = nnls(a, b)
    coefficients = known.copy()
    coefficients[free] = solution
    return float(np.linalg.norm(a @ solution - b)), coefficients, knee


def _label_means(samples: Sequence[StepSample]) -> np.ndarray:
    """Each sample's grid-point mean step time (its weight's scale)."""
    totals: dict[str, list[float]] = {}
    for s in samples:
        totals.setdefault(s.label, []).append(s.seconds)
    means = {label: float(np.mean(values)) for label, values in totals.items()}
    return np.array([means[s.label] for s in samples])


def fit_report(model: CostModel, samples: Sequence[StepSample]) -> dict:
    """Per grid point: mean measured and predicted step seconds, relative error."""
    by_label: dict[str, list[StepSample]] = {}
    for sample in samples:
        by_label.setdefault(sample.label, []).append(sample)
    points = []
    for label, group in by_label.items():
        measured = float(np.mean([s.seconds for s in group]))
        predicted = float(np.mean([model.time_of(s.shape) for s in group]))
        points.append({"label": label, "steps": len(group), "measured_s": measured,
                       "predicted_s": predicted, "rel_error": predicted / measured - 1})
    step_errors = np.array([model.time_of(s.shape) / s.seconds - 1 for s in samples])
    return {
        "num_steps": len(samples),
        "median_abs_rel_error": float(np.median(np.abs(step_errors))),
        "mean_abs_rel_error": float(np.mean(np.abs(step_errors))),
        "points": points,
    }


def format_fit(fit: dict) -> str:
    """The fit error table of `fit_report`'s result: per grid point, its steps,
    mean measured and predicted seconds and the relative error (markdown)."""
    lines = [f"per-step error median {fit['median_abs_rel_error'] * 100:.1f} %, "
             f"mean {fit['mean_abs_rel_error'] * 100:.1f} % over {fit['num_steps']} steps",
             "", "| grid point | steps | measured, s | predicted, s | error |",
             "|---|---|---|---|---|"]
    lines += [f"| {p['label']} | {p['steps']} | {p['measured_s']:.4f} | {p['predicted_s']:.4f} | "
              f"{p['rel_error'] * 100:+.1f} % |" for p in fit["points"]]
    return "\n".join(lines)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > 1e-12 * max(1.0, np.abs(gradient).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            # A variable at 0 that the least squares also puts at 0 (rank-deficient
            # columns) stops the step at once: it leaves the passive set below.
            gap = x[bad] - z[bad]
            step = np.min(np.divide(x[bad], gap, out=np.zeros_like(gap), where=gap > 0))
            x = x + step * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


@dataclass(slots=True, frozen=True)
class CostProfile:
    """A fitted cost model and everything that says what it describes."""

    cost: CostModel
    fit: dict
    machine: dict
    model: dict
    grid: dict
    created: str
    samples: tuple[StepSample, ...] = ()
    layout: ModelLayout = ModelLayout()

    def to_dict(self) -> dict:
        return {
            "type": PROFILE_TYPE,
            "version": PROFILE_VERSION,
            "cost": self.cost.to_dict(),
            "fit": self.fit,
            "machine": self.machine,
            "mlx_version": self.machine.get("mlx_version"),
            "blas": self.machine.get("blas"),
            "model": self.model,
            "layout": self.layout.to_dict(),
            "grid": self.grid,
            "created": self.created,
            "step_fields": list(COEFFICIENTS),
            "steps": [[s.label, s.seconds, list(s.shape.terms(self.cost.decode_context_knee))]
                      for s in self.samples],
        }


def write_profile(path: str | Path, profile: CostProfile) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=1) + "\n")


def _read_profile(path: str | Path) -> dict:
    """A profile file's JSON, its type and version checked. Raises `ProfileError`."""
    data = read_json(path, "profile", ProfileError)
    if not isinstance(data, dict) or data.get("type") != PROFILE_TYPE:
        raise ProfileError(f"{path} is not a cost profile (no \"type\": \"{PROFILE_TYPE}\")")
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{path}: profile version {data.get('version')!r} "
                           f"is not {PROFILE_VERSION}")
    return data


def read_layout(path: str | Path) -> ModelLayout:
    """The layout a profile was calibrated on ("full" when it names none).
    Raises `ProfileError`."""
    data = _read_profile(path)
    try:
        return ModelLayout.from_dict(data.get("layout", {}))
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: layout: {exc}") from None


def read_fit(path: str | Path) -> dict:
    """The fit report of a profile file (its "points": each grid point's
    measured and predicted mean step seconds). Raises `ProfileError`."""
    fit = _read_profile(path).get("fit")
    if not isinstance(fit, dict) or not isinstance(fit.get("points"), list):
        raise ProfileError(f"{path}: \"fit\" must be an object with a \"points\" list")
    return fit


def read_cost(path: str | Path) -> CostModel:
    """The `CostModel` of a profile file. Raises `ProfileError`."""
    data = _read_profile(path)
    cost = data.get("cost")
    known = {f.name for f in fields(CostModel)}
    if not isinstance(cost, dict) or set(cost) - known:
        raise ProfileError(f"{path}: \"cost\" must be an object with keys among "
                           f"{', '.join(sorted(known))}")
    try:
        return CostModel(**cost)
    except ValueError as exc:
        raise ProfileError(f"{path}: {exc}") from None
