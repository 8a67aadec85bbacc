"""Constrained decoding: grammars that decide which tokens a sample may draw.

A `Constraint` (`SamplingParams.constraint`) is one request's compiled
grammar; each of its samples gets its own `RowMatcher` from it
(`new_matcher()`). Before a step's forward the engine asks the matcher of
every constrained row for its mask (`allowed(output)`, a bitmask of
``ceil(V / 32)`` int32 words, bit t of word t // 32 set when token t may
come next); the matcher first consumes the output tokens it has not seen,
so preemption, recompute and forks need no other bookkeeping. The sampler
sets the logits of the other tokens to -inf (`sampling.mask_logits`), for
the constrained rows only: a step without one pays nothing.

`Grammars` builds constraints with llguidance (the `structured` extra):
JSON Schema (`json_schema`, OpenAI's strict mode and more), any JSON object
(`json_object`). llguidance was chosen over xgrammar by
`benchmarks/compare_grammars.py` (BENCHMARKS.md, "constrained decoding"):
both valid on the strict-mode features, llguidance builds a matcher 5-30x
faster, sets up a tokenizer 6x faster, costs the same per token, and needs
no torch. Without llguidance, `Grammars.available()` is False and building
one raises `GrammarUnavailable` (a server answers 400).

Cost: llguidance's mask for one row, about 0.1-0.3 ms per token on a 32k
vocabulary (its own thread, GIL released), plus one unpack of the bitmask.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from blockmgr.errors import InvalidArgument


class GrammarUnavailable(InvalidArgument):
    """Constrained decoding needs the `structured` extra (llguidance)."""


class GrammarError(RuntimeError):
    """A matcher failed (the grammar reached a state it cannot leave, or a
    token it refused was drawn): the fault of its own request."""


@runtime_checkable
class RowMatcher(Protocol):
    """One sample's position in a grammar."""

    def allowed(self, output: Sequence[int]) -> np.ndarray:
        """The int32 bitmask of the tokens that may follow `output` (the
        sample's tokens so far; the matcher consumes those it has not seen).
        Raises on a fault (`GrammarError`)."""
        ...


@runtime_checkable
class Constraint(Protocol):
    """A request's compiled grammar."""

    def new_matcher(self) -> RowMatcher: ...


@runtime_checkable
class FastTokenizer(Protocol):
    """A Hugging Face fast tokenizer (mlx-lm's wrapper forwards to it):
    llguidance reads its Rust tokenizer's JSON."""

    backend_tokenizer: Any


class _LlgMatcher:
    """An llguidance matcher that catches up on a sample's output."""

    __slots__ = ("_matcher", "_num_consumed", "_words")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._num_consumed = 0
        self._words = (vocab_size + 31) // 32

    def allowed(self, output: Sequence[int]) -> np.ndarray:
        matcher = self._matcher
        if len(output) < self._num_consumed:
            raise GrammarError("a sample's output shrank under its grammar")
        new = list(output[self._num_consumed:])
        if new and not matcher.consume_tokens(new):
            raise GrammarError(f"the grammar refused a token: {matcher.get_error()}")
        self._num_consumed = len(output)
        if matcher.is_error():
            raise GrammarError(f"the grammar failed: {matcher.get_error()}")
        mask = np.zeros(self._words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error() or not mask.any():
            raise GrammarError(f"the grammar allows no token: {matcher.get_error()}")
        return mask


class _LlgConstraint:
    __slots__ = ("_tokenizer", "_grammar", "_vocab_size")

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int) -> None:
        self._tokenizer, self._grammar, self._vocab_size = tokenizer, grammar, vocab_size

    def new_matcher(self) -> RowMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return _LlgMatcher(matcher, self._vocab_size)


class Grammars:
    """Builds constraints for one tokenizer (an mlx-lm `TokenizerWrapper` or
    a Hugging Face fast tokenizer) and a model vocabulary of `vocab_size`.
    The llguidance tokenizer is built on first use (about 1 s for a 150k
    vocabulary); thread-safe after that."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._llg: Any = None

    @staticmethod
    def available() -> bool:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return True

    def json_schema(self, schema: Mapping[str, Any]) -> Constraint:
        """Text that parses as JSON and validates against `schema` (no extra
        whitespace). `InvalidArgument` for a schema llguidance refuses."""
        if not isinstance(schema, Mapping):
            raise InvalidArgument(f"a JSON schema must be an object, got {schema!r:.80}")
        self._tokenizer()  # GrammarUnavailable without llguidance
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as error:
            raise InvalidArgument(f"the JSON schema cannot be compiled: {error}") from None
        return self._compiled(grammar)

    def json_object(self) -> Constraint:
        """Text that parses as one JSON object."""
        return self.json_schema({"type": "object"})

    def _compiled(self, grammar: str) -> Constraint:
        import llguidance

        tokenizer = self._tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidArgument(f"the grammar is not valid: {error}"[:500])
        return _LlgConstraint(tokenizer, grammar, self._vocab_size)

    def _tokenizer(self) -> Any:
        if self._llg is None:
            try:
                import llguidance
            except ImportError:
                raise GrammarUnavailable(
                    "constrained decoding needs llguidance: pip install "
                    "'mlx-blockmgr[structured]'") from None
            if not isinstance(self._hf, FastTokenizer):
                raise GrammarUnavailable(
                    "constrained decoding needs a fast (Rust) Hugging Face tokenizer")
            backend = copy.copy(self._hf.backend_tokenizer)  # a fast (Rust) tokenizer's
            backend.no_padding()
            backend.no_truncation()
            self._llg = llguidance.LLTokenizer(backend.to_str(), n_vocab=self._vocab_size,
                                               eos_token=self._eos or None)
        return self._llg


def unpack_masks(masks: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """Bool ``[len(masks), vocab_size]`` of int32 bitmasks (little-endian
    bits, as llguidance and xgrammar write them)."""
    words = np.stack(masks).astype(np.int32, copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    width = bits.shape[1]
    if width < vocab_size:  # tokens past the grammar's vocabulary: never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - width)))
    return bits[:, :vocab_size].astype(bool)
