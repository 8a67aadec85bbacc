"""The infinite-cache prefix hit rate of a workload: what a prefix cache
that never evicts could serve.

Requests are taken in arrival order. Each prompt hits the longest prefix it
shares with any earlier request's prompt or prompt + output (a follow-up
turn contains the previous answer), capped at the prompt length minus one
token (the block manager always leaves one token to compute). The figure is
token-weighted: hit tokens over prompt tokens. Prompts are compared segment
by segment (`(key, length)` texts, see tokens.py; a text is a prefix of the
same key's longer text), so the cost is O(segments) per request, not
O(tokens); explicit token prompts cost O(tokens). Namespaces never share.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from scheduler.simulator.workloads import RequestSpec

# (text key, length in tokens); an explicit token prompt's segments are (("token", id), 1)
Segment = tuple[Hashable, int]


class PrefixBound:
    """Accumulates the bound over requests given in arrival order.

    Memory: one dict entry per distinct (prefix, segment) seen, so
    O(distinct segments of the workload).
    """

    def __init__(self) -> None:
        self._longest: dict[tuple[int, object], int] = {}
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def observe(self, spec: RequestSpec) -> int:
        """Count `spec`'s hit against everything observed before, then
        remember its texts. Returns the hit in tokens."""
        prompt = _segments(spec)
        root = hash(("namespace", spec.namespace))
        hit = min(self._match(root, prompt), spec.prompt_len - 1)
        self.hit_tokens += hit
        self.query_tokens += spec.prompt_len
        end = self._insert(root, prompt)
        for sample in range(spec.n):
            self._insert(end, (spec.output_segment(sample),))
        return hit

    def _match(self, node: int, segments: Iterable[Segment]) -> int:
        matched = 0
        longest = self._longest
        for key, length in segments:
            seen = longest.get((node, key), 0)
            if seen < length:
                return matched + seen
            matched += length
            node = hash((node, key, length))
        return matched

    def _insert(self, node: int, segments: Iterable[Segment]) -> int:
        longest = self._longest
        for key, length in segments:
            slot = (node, key)
            if longest.get(slot, 0) < length:
                longest[slot] = length
            node = hash((node, key, length))
        return node


def _segments(spec: RequestSpec) -> Iterable[Segment]:
    if spec.tokens is None:
        return spec.prompt
    return [(("token", token), 1) for token in spec.tokens]


def infinite_cache_hit_rate(specs_in_arrival_order: Iterable[RequestSpec]) -> float:
    """The bound over `specs` (see the module docstring)."""
    bound = PrefixBound()
    for spec in specs_in_arrival_order:
        bound.observe(spec)
    return bound.hit_rate
