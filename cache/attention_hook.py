"""Route mlx-lm's attention call to paged views, so history is not gathered.

mlx-lm's models call ``scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=...)`` from ``mlx_lm.models.base`` right after
``cache.update_and_fetch``. `install` wraps that function (in ``base`` and
in every loaded ``mlx_lm.models`` module that imported it; modules imported
later pick the wrapper up from ``base``): when the cache is an
`AttentionView` that can serve the call exactly (`AttentionView.attend`),
attention runs page by page on the pool and the lazily gathered history is
never evaluated; any other call goes to mlx-lm's function unchanged.

Process-wide and idempotent; `PagedCache` installs it unless built with
``paged_attention=False``. Models that call MLX's kernel directly still
work: they read the gathered history, as without the hook.
"""

from __future__ import annotations

import sys

from cache.views import AttentionView

_ATTR = "scaled_dot_product_attention"
_original = None  # mlx-lm's function while installed


def install() -> bool:
    """Wrap mlx-lm's attention function; False when mlx-lm is not importable."""
    global _original
    try:
        from mlx_lm.models import base
    except ImportError:
        return False
    if _original is not None:
        return True
    _original = getattr(base, _ATTR)
    _replace(_original, paged_scaled_dot_product_attention)
    return True


def uninstall() -> None:
    """Restore mlx-lm's function everywhere it was wrapped."""
    global _original
    if _original is not None:
        _replace(paged_scaled_dot_product_attention, _original)
        _original = None


def is_installed() -> bool:
    return _original is not None


def paged_scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's signature; paged for views that can serve the call, else mlx-lm's."""
    if sinks is None and isinstance(cache, AttentionView):
        out = cache.attend(queries, keys, values, scale, mask)
        if out is not None:
            return out
    return _original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _replace(old, new) -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models") and getattr(module, _ATTR, None) is old:
            setattr(module, _ATTR, new)
