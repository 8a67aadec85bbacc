"""The greedy reference: mlx-lm's own decode of a prompt, on its own KV caches.

Every engine and storage test that checks greedy outputs compares against this
(`generate_step`, mlx-lm's make_prompt_cache caches), never against our code.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The `max_tokens` tokens mlx-lm's `generate_step` decodes greedily after
    `prompt` (one prefill, then one forward a token)."""
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]
