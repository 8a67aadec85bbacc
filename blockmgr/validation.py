"""Argument checks shared by every layer (block manager, scheduler, engine).

Each check either returns the value in its canonical form or raises a typed
error from `blockmgr.errors` whose message names the bad value:
`WrongArgumentType` (a `TypeError` and an `InvalidArgument`) for a value of
the wrong kind, `InvalidArgument` (a `ValueError`) for one out of range.
Nothing is changed by a failing check, so a caller that checks everything
first changes nothing when a check fails.

Token lists are checked at C speed: a Python list of exact ints is copied
once and converted once into an unsigned 64-bit `array` (which refuses
floats, None, strings, nested lists and negative numbers); only a list that
fails that conversion, or input of another kind, takes the slower path that
finds the bad element or converts numpy integers to ints.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Hashable, Iterable
from typing import TypeVar, cast

import numpy as np

from blockmgr.errors import InvalidArgument, WrongArgumentType

#: Lists up to this length are checked element by element in Python (a
#: decode step's one token costs less that way than an array conversion).
_SHORT = 4
#: Token ids are unsigned 64-bit ints (the prefix trie packs them so).
MAX_TOKEN_ID = 2**64 - 1

T = TypeVar("T")


def as_words(tokens: list[int]) -> array[int]:
    """The ints of list `tokens` as an unsigned 64-bit `array('Q')`; raises
    `TypeError` for an element that is not an int (bools and numpy integers
    convert) and `OverflowError` for one outside [0, 2**64). O(n) at C speed.

    `array('Q').fromlist` makes exactly the conversion of `array('Q', tokens)`
    (the same per-element setter), about 1.5x as fast on CPython 3.11.
    """
    words = array("Q")
    words.fromlist(tokens)
    return words


def token_list(tokens: Iterable[int], name: str = "tokens", *, exact: bool = False) -> list[int]:
    """A new list of the non-negative int token ids in `tokens`.

    Accepts a list, tuple, any iterable, a 1-D numpy integer array, with
    ints or numpy integer scalars as elements (converted to int). Refuses a
    str/bytes/int/None in place of the list, and elements that are bools,
    floats, None, strings, nested or unhashable objects, or negative.

    Cost: a list of exact ints is copied and converted to an `array('Q')`
    once, at C speed (about 5 ns per token); other input is converted first.
    Without `exact`, a bool or numpy integer inside a long list whose first
    and last elements are ints is kept as it is (equal to, and hashing as,
    its int value: bool is an int subclass, and telling it apart costs a
    Python-level pass); `exact=True` makes that pass, for callers whose
    per-call cost is dominated by something else (the engine's admission).
    """
    if type(tokens) is list:
        if len(tokens) <= _SHORT:
            for token in tokens:
                if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
                    return _slow_token_list(tokens, name)
            return tokens[:]
        if exact or type(tokens[0]) is not int or type(tokens[-1]) is not int:
            return _slow_token_list(tokens, name)
        try:
            as_words(tokens)
        except (TypeError, OverflowError):
            return _slow_token_list(tokens, name)
        return tokens[:]
    return _slow_token_list(tokens, name)


def prompt_list(tokens: Iterable[int], name: str = "prompt", *, exact: bool = False) -> list[int]:
    """`token_list`, and at least one token."""
    tokens = token_list(tokens, name, exact=exact)
    if not tokens:
        raise InvalidArgument(f"{name} needs at least one token, got none")
    return tokens


def packed_prompt(tokens: Iterable[int], name: str = "prompt") -> tuple[list[int], bytes]:
    """`prompt_list(tokens)` and the same ids packed as unsigned 64-bit words
    (`array('Q')` bytes, what the prefix trie compares with memcmp).

    For a list of exact ints the one `array('Q')` conversion is both the
    check and the packing. O(n) at C speed.
    """
    if type(tokens) is list and tokens and type(tokens[0]) is int and type(tokens[-1]) is int:
        try:
            packed = as_words(tokens)
        except (TypeError, OverflowError):
            pass  # the slow path names the bad element
        else:
            return tokens[:], packed.tobytes()
    tokens = prompt_list(tokens, name)
    return tokens, as_words(tokens).tobytes()


def decode_tokens(tokens: Iterable[int], num_rows: int, name: str = "tokens") -> list[int]:
    """`token_list(tokens)` of one token per row of a batched decode step:
    exactly `num_rows` of them. O(n) at C speed."""
    tokens = token_list(tokens, name)
    if len(tokens) != num_rows:
        raise InvalidArgument(f"{name} needs one token per row ({num_rows}), got {len(tokens)}")
    return tokens


def check_token_range(tokens: list[int], vocab_size: int, name: str = "prompt") -> None:
    """Every id (already a `token_list`) is below `vocab_size`. O(n) at C speed."""
    if tokens:
        top = max(tokens)
        if top >= vocab_size:
            index = tokens.index(top)
            raise InvalidArgument(
                f"{name}[{index}] = {top} is not a token id of this model "
                f"(vocab_size {vocab_size})"
            )


def _slow_token_list(tokens: object, name: str) -> list[int]:
    """Convert any accepted input to a list of ints, or name the bad element."""
    if isinstance(tokens, np.ndarray):
        return _array_token_list(tokens, name)
    if isinstance(tokens, (str, bytes, bytearray, int, float, np.generic)) or tokens is None:
        raise WrongArgumentType(f"{name} must be a sequence of token ids, got {tokens!r:.80}")
    try:
        items = list(tokens)  # type: ignore[call-overload]  # any iterable: checked below
    except TypeError:
        raise WrongArgumentType(
            f"{name} must be a sequence of token ids, got {tokens!r:.80}"
        ) from None
    for index, token in enumerate(items):
        if type(token) is not int:
            items[index] = token = _as_int(token, f"{name}[{index}]", "an int token id")
        if token < 0:
            raise InvalidArgument(f"{name}[{index}] = {token} is negative")
        if token > MAX_TOKEN_ID:
            raise InvalidArgument(f"{name}[{index}] = {token} is not below 2**64")
    return cast("list[int]", items)


def _array_token_list(tokens: np.ndarray, name: str) -> list[int]:
    if tokens.ndim != 1:
        raise WrongArgumentType(
            f"{name} must be 1-D token ids, got an array of shape {tokens.shape}"
        )
    if tokens.dtype.kind not in "iu":
        raise WrongArgumentType(f"{name} must hold integers, got dtype {tokens.dtype}")
    if tokens.size and tokens.dtype.kind == "i" and int(tokens.min()) < 0:
        index = int(tokens.argmin())
        raise InvalidArgument(f"{name}[{index}] = {int(tokens[index])} is negative")
    return cast("list[int]", tokens.tolist())


def _as_int(value: object, name: str, what: str = "an int") -> int:
    """An int or numpy integer as an int; anything else refused (`name`
    must be `what`)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return operator.index(value)
    raise WrongArgumentType(f"{name} must be {what}, got {value!r:.80}")


def check_int(
    name: str,
    value: object,
    minimum: int | None = 0,
    maximum: int | None = None,
    *,
    strict: bool = False,
) -> int:
    """`value` as an int in [minimum, maximum] (None: unbounded). Numpy
    integers are accepted and converted, unless `strict` (a config, which
    keeps the value it was given and writes it to JSON, takes Python ints
    only); bools and floats are refused."""
    if type(value) is not int:  # an exact int is its own int: skip the conversion
        if strict:
            raise WrongArgumentType(f"{name} must be an int, got {value!r:.80}")
        value = _as_int(value, name)
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name} must be <= {maximum}, got {value}")
    return value


def check_count(name: str, value: object) -> int:
    """`value` as an int >= 0 (an exact int costs one type check)."""
    if type(value) is int and value >= 0:
        return value
    return check_int(name, value, 0)


def check_number(
    name: str,
    value: object,
    minimum: float | None = None,
    *,
    above: float | None = None,
    below: float | None = None,
) -> float:
    """A finite real number (int or float, numpy ones too; not bool) as a
    float, at least `minimum`, greater than `above` and less than `below`
    (None: unbounded)."""
    real = (int, float, np.integer, np.floating)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, real):
        raise WrongArgumentType(f"{name} must be a number, got {value!r:.80}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidArgument(f"{name} must be finite, got {value!r}")
    if minimum is not None and number < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value!r}")
    if above is not None and number <= above:
        raise InvalidArgument(f"{name} must be > {above}, got {value!r}")
    if below is not None and number >= below:
        raise InvalidArgument(f"{name} must be < {below}, got {value!r}")
    return number


def check_bool(name: str, value: object) -> bool:
    """`value` as a bool: a bool (or numpy bool); anything else refused, 0
    and 1 too (a flag is never a count)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise WrongArgumentType(f"{name} must be a bool, got {value!r:.80}")


def check_choice(name: str, value: T, choices: Iterable[T]) -> T:
    """`value` if it equals one of `choices`, else `InvalidArgument` naming
    them. O(len(choices))."""
    options = tuple(choices)
    if value not in options:
        listed = ", ".join(repr(option) for option in options)
        raise InvalidArgument(f"{name} must be one of {listed}, got {value!r:.80}")
    return value


def check_hashable(name: str, value: object) -> Hashable:
    try:
        hash(value)
    except TypeError:
        raise WrongArgumentType(f"{name} must be hashable, got {value!r:.80}") from None
    return value
