"""The command line's argument types: each parses one option's text or
raises `argparse.ArgumentTypeError` (one line); `Parser` turns argparse's
errors into `UsageError`."""

from __future__ import annotations

import argparse
import json

from scheduler.simulator.lengths import LengthSpecError, parse_length
from scheduler.simulator.workloads import WORKLOAD_KINDS


class UsageError(Exception):
    """A bad command line; the message is printed on one line (exit 2)."""


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors raise `UsageError` (`main` prints it
    on one line and exits 2) instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(message)


def parse_mix(spec: str) -> dict[str, float]:
    """``chat`` | ``chat,agent`` | ``chat=0.7,agent=0.3`` | ``all`` -> weights."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty workload")
    if spec.strip() == "all":
        return {kind: 1.0 for kind in WORKLOAD_KINDS}
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, eq, weight = part.partition("=")
        kind = kind.strip().lower()
        if kind not in WORKLOAD_KINDS:
            raise ValueError(f"unknown workload {kind!r} (one of "
                             f"{', '.join(WORKLOAD_KINDS)}, or all)")
        try:
            value = float(weight) if eq else 1.0
        except ValueError:
            raise ValueError(f"workload weight must be a number, got {weight!r}") from None
        if not value >= 0:
            raise ValueError(f"workload weight must be >= 0, got {weight!r}")
        mix[kind] = mix.get(kind, 0.0) + value
    return mix


def int_at_least(minimum: int):
    """An argparse type: an int >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonneg_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def length_dist(text: str):
    """An argparse type: a length distribution (`parse_length`: fixed:512,
    lognormal:mean=120, ...)."""
    try:
        return parse_length(text)
    except LengthSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def workload_mix(text: str) -> dict[str, float]:
    """An argparse type: workload kinds and weights (`parse_mix`)."""
    try:
        return parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cost_overrides(text: str) -> dict[str, float]:
    """An argparse type: ``name=seconds,...`` of the cost model's fields."""
    from scheduler.simulator.cost_model import CostModel

    known = CostModel.__dataclass_fields__
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            raise argparse.ArgumentTypeError(
                f"expected key=seconds with key in {', '.join(known)}, got {part!r}"
            )
        out[key] = nonneg_float(value)
    return out


def key_values(text: str) -> dict:
    """An argparse type: ``key=value,...`` with JSON values (numbers,
    true/false); other values are strings."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out
