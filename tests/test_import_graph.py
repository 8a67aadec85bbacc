"""Imports go one way: scheduler -> cache -> recurrent -> blockmgr.

Every import statement of the four packages (at module level or inside a
function: a lazy import is still an edge) is read from the source with
`ast`; an edge that points up the layering, or `blockmgr` importing MLX,
fails the test naming the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("blockmgr", "recurrent", "cache", "scheduler")  # lowest first
#: Third-party packages a layer must not import.
FORBIDDEN = {"blockmgr": {"mlx", "mlx_lm"}}


def imported_packages(source: str, module: str) -> list[tuple[str, int]]:
    """(top-level package, line) of every import in `source`, the module
    `module` (dotted), relative imports resolved."""
    found = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.append(((base or [""])[0], node.lineno))
            elif node.module:
                found.append((node.module.split(".")[0], node.lineno))
    return found


def upward_edges(source: str, module: str) -> list[str]:
    """The imports of `module` that break the layering, described."""
    layer = module.split(".")[0]
    rank = LAYERS.index(layer)
    bad = []
    for package, line in imported_packages(source, module):
        if package in LAYERS and LAYERS.index(package) > rank:
            bad.append(f"{module}:{line} imports {package} (above {layer})")
        if package in FORBIDDEN.get(layer, ()):
            bad.append(f"{module}:{line} imports {package}")
    return bad


def package_modules():
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts), path


def test_no_import_points_up_the_layering():
    bad = []
    for module, path in package_modules():
        bad += upward_edges(path.read_text(), module)
    assert bad == []


def test_every_layer_has_modules_to_check():
    layers = {module.split(".")[0] for module, _ in package_modules()}
    assert layers == set(LAYERS)


@pytest.mark.parametrize("source, module, expected", [
    ("import cache\n", "recurrent.pools", ["recurrent.pools:1 imports cache (above recurrent)"]),
    ("def f():\n    from scheduler.engine.engine import Engine\n", "cache.paged_cache",
     ["cache.paged_cache:2 imports scheduler (above cache)"]),
    ("import mlx.core as mx\n", "blockmgr.pool", ["blockmgr.pool:1 imports mlx"]),
    ("from ..cache import views\n", "recurrent.sub.x", []),  # resolves to `recurrent`
    ("from . import ops\n", "recurrent.views", []),
    ("from blockmgr import ops\nimport recurrent\n", "cache.x", []),
])
def test_the_checker_finds_upward_and_lazy_imports(source, module, expected):
    assert upward_edges(source, module) == expected
