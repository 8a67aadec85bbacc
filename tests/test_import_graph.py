"""Imports go one way: scheduler -> cache -> recurrent -> blockmgr, and
inside `scheduler/` from room to room: cli -> serving -> simulator -> engine
-> core (design/ARCHITECTURE.md).

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
#: The rooms of `scheduler/`, lowest first; `scheduler/__init__` (the public
#: names) is the front door above them all, which no room imports.
ROOMS = ("core", "engine", "simulator", "serving", "cli")
FRONT_DOOR = len(ROOMS)


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


def imported_modules(source: str) -> list[tuple[str, int]]:
    """(dotted module, line) of every absolute import of `scheduler` in
    `source`; `from scheduler import x` names `scheduler.x`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name.split(".")[0] == "scheduler"]


def room_rank(module: str) -> int:
    """The rank of the room that holds `module` (dotted, under `scheduler`):
    its position in ROOMS; the front door (or a name it re-exports) is above
    them all."""
    parts = module.split(".")
    return ROOMS.index(parts[1]) if len(parts) > 1 and parts[1] in ROOMS else FRONT_DOOR


def upward_room_edges(source: str, module: str) -> list[str]:
    """The imports of `module` (in a room of `scheduler`) that point to a
    higher room, described; the front door itself may import any room."""
    if module == "scheduler":
        return []
    rank = room_rank(module)
    room = ROOMS[rank]
    return [
        f"{module}:{line} imports {name} (above {room})"
        for name, line in imported_modules(source)
        if room_rank(name) > rank
    ]


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


def scheduler_modules():
    """(dotted name, path) of every module of `scheduler` (a package by its
    own name, `scheduler` for the front door)."""
    for module, path in package_modules():
        if module.split(".")[0] == "scheduler":
            yield module.removesuffix(".__init__"), path


def test_no_import_points_up_the_rooms_of_scheduler():
    bad = []
    for module, path in scheduler_modules():
        bad += upward_room_edges(path.read_text(), module)
    assert bad == []


def test_every_module_of_scheduler_is_in_a_room():
    modules = [module for module, _ in scheduler_modules() if module != "scheduler"]
    assert [module for module in modules if room_rank(module) == FRONT_DOOR] == []
    assert {module.split(".")[1] for module in modules} == set(ROOMS)


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


@pytest.mark.parametrize("source, module, expected", [
    ("from scheduler.engine.engine import Engine\n", "scheduler.core.scheduler",
     ["scheduler.core.scheduler:1 imports scheduler.engine.engine.Engine (above core)"]),
    ("def f():\n    import scheduler.serving.serve\n", "scheduler.simulator.sweep",
     ["scheduler.simulator.sweep:2 imports scheduler.serving.serve (above simulator)"]),
    ("from scheduler import Engine\n", "scheduler.serving.server",
     ["scheduler.serving.server:1 imports scheduler.Engine (above serving)"]),
    ("from scheduler.serving import serve\n", "scheduler.engine.engine",
     ["scheduler.engine.engine:1 imports scheduler.serving.serve (above engine)"]),
    ("from scheduler.core.request import Request\nimport cache\n",
     "scheduler.serving.server", []),
    ("from scheduler.serving import serve\n", "scheduler.cli", []),
    ("from scheduler.engine import engine\n", "scheduler", []),
    ("from . import tokens\n", "scheduler.simulator.trace", []),
])
def test_the_checker_finds_imports_up_the_rooms(source, module, expected):
    assert upward_room_edges(source, module) == expected
