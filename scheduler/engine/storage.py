"""Deprecated: `build_storage` is `cache.PagedCache.for_model` (kept for one
release; the composition lives in `cache.model_storage`)."""

from __future__ import annotations

from typing import Any

from cache.paged_cache import PagedCache


def build_storage(model: Any, num_blocks: int, block_size: int = 16, **kwargs: Any) -> PagedCache:
    """Deprecated alias of `PagedCache.for_model(model, num_blocks, block_size, **kwargs)`."""
    return PagedCache.for_model(model, num_blocks, block_size, **kwargs)
