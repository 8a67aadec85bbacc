"""Length distributions: how many tokens a text, an output or a session has.

A `LengthDist` is parsed from a short spec string (the CLI and trace headers
use the same syntax) and samples integers with a numpy `Generator`, clamped
to [min, max]:

    fixed:128                     always 128
    uniform:50,500                uniform integers in [50, 500]
    lognormal:mean=200,sigma=0.8  lognormal with that mean (not median)
    exponential:mean=100          exponential with that mean
    normal:mean=200,std=40        normal

Any kind takes ``min=`` and ``max=`` keywords (defaults 1 and 1,000,000).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("fixed", "uniform", "lognormal", "exponential", "normal")
_DEFAULT_MAX = 1_000_000


class LengthSpecError(ValueError):
    """A length spec string does not parse or is out of range."""


@dataclass(slots=True, frozen=True)
class LengthDist:
    """A distribution of positive integer lengths; validated on construction.

    kind: one of `KINDS`. a, b: the kind's parameters (fixed: a = value;
    uniform: [a, b]; lognormal: mean a, sigma b; exponential: mean a;
    normal: mean a, std b). low, high: clamp bounds, 1 <= low <= high.
    """

    kind: str
    a: float
    b: float = 0.0
    low: int = 1
    high: int = _DEFAULT_MAX

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LengthSpecError(f"unknown length kind {self.kind!r} (one of {', '.join(KINDS)})")
        if not (isinstance(self.low, int) and isinstance(self.high, int)) or not (
            1 <= self.low <= self.high
        ):
            raise LengthSpecError(f"length bounds must satisfy 1 <= min <= max, "
                                  f"got {self.low}, {self.high}")
        for name, value in (("a", self.a), ("b", self.b)):
            if not math.isfinite(value) or value < 0:
                raise LengthSpecError(f"length parameters must be finite and >= 0, "
                                      f"got {name}={value}")
        if self.kind == "uniform" and self.a > self.b:
            raise LengthSpecError(f"uniform needs low <= high, got {self.a:g},{self.b:g}")
        if self.kind in ("fixed", "lognormal", "exponential", "normal") and self.a <= 0:
            raise LengthSpecError(f"{self.kind} needs a positive mean/value, got {self.a:g}")

    @property
    def mean(self) -> float:
        """The mean before clamping (used for sizing estimates only)."""
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` lengths as an int64 array. O(size)."""
        kind = self.kind
        if kind == "fixed":
            values = np.full(size, self.a)
        elif kind == "uniform":
            values = rng.integers(int(self.a), int(self.b) + 1, size=size)
        elif kind == "lognormal":
            sigma = self.b
            mu = math.log(self.a) - sigma * sigma / 2
            values = rng.lognormal(mu, sigma, size=size)
        elif kind == "exponential":
            values = rng.exponential(self.a, size=size)
        else:
            values = rng.normal(self.a, self.b, size=size)
        return np.clip(np.rint(values), self.low, self.high).astype(np.int64)

    def one(self, rng: np.random.Generator) -> int:
        """`int(self.sample(rng, 1)[0])`: the same draw from the same stream,
        as a scalar (a third of the cost of a one-element array)."""
        kind = self.kind
        if kind == "fixed":
            value = self.a
        elif kind == "uniform":
            value = int(rng.integers(int(self.a), int(self.b) + 1))
        elif kind == "lognormal":
            sigma = self.b
            value = rng.lognormal(math.log(self.a) - sigma * sigma / 2, sigma)
        elif kind == "exponential":
            value = rng.exponential(self.a)
        else:
            value = rng.normal(self.a, self.b)
        return min(max(round(float(value)), self.low), self.high)  # round: half to even, as rint

    def spec(self) -> str:
        """The spec string that parses back to this distribution."""
        if self.kind == "fixed":
            body = f"{self.a:g}"
        elif self.kind == "uniform":
            body = f"{self.a:g},{self.b:g}"
        elif self.kind == "lognormal":
            body = f"mean={self.a:g},sigma={self.b:g}"
        elif self.kind == "exponential":
            body = f"mean={self.a:g}"
        else:
            body = f"mean={self.a:g},std={self.b:g}"
        bounds = ""
        if self.low != 1:
            bounds += f",min={self.low}"
        if self.high != _DEFAULT_MAX:
            bounds += f",max={self.high}"
        return f"{self.kind}:{body}{bounds}"


_KEYWORDS = {
    "fixed": ("value",),
    "uniform": ("low", "high"),
    "lognormal": ("mean", "sigma"),
    "exponential": ("mean",),
    "normal": ("mean", "std"),
}


def parse_length(spec: str) -> LengthDist:
    """Parse a spec such as ``lognormal:mean=200,sigma=0.8,max=2000``.

    A bare integer ("128") means ``fixed:128``. Raises `LengthSpecError`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise LengthSpecError(f"empty length spec {spec!r}")
    text = spec.strip()
    if ":" not in text:
        text = f"fixed:{text}"
    kind, _, body = text.partition(":")
    kind = kind.strip().lower()
    if kind not in _KEYWORDS:
        raise LengthSpecError(f"unknown length kind {kind!r} in {spec!r} "
                              f"(one of {', '.join(KINDS)})")
    names = _KEYWORDS[kind]
    params: dict[str, float] = {}
    positional = 0
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            if positional >= len(names):
                raise LengthSpecError(f"too many values in {spec!r}")
            key, value = names[positional], part
            positional += 1
        key = key.strip().lower()
        if key not in names and key not in ("min", "max"):
            raise LengthSpecError(f"unknown parameter {key!r} for {kind} in {spec!r}")
        try:
            params[key] = float(value)
        except ValueError:
            raise LengthSpecError(f"not a number: {value!r} in {spec!r}") from None
    missing = [name for name in names
               if name not in params and not (kind == "lognormal" and name == "sigma")]
    if missing:
        raise LengthSpecError(f"{spec!r} is missing {', '.join(missing)}")
    low = params.get("min", 1.0)
    high = params.get("max", float(_DEFAULT_MAX))
    if low != int(low) or high != int(high):
        raise LengthSpecError(f"min and max must be integers in {spec!r}")
    a = params[names[0]]
    b = params.get(names[1], 1.0 if kind == "lognormal" else 0.0) if len(names) > 1 else 0.0
    return LengthDist(kind, a, b, int(low), int(high))
