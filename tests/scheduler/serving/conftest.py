"""Fixtures shared by the server tests: one served tiny model per module.

`tests/scheduler/serving/test_server.py` and the server test modules that
drive the same server (`test_server_pins.py`) request these by name; a
module that serves another model defines its own fixtures of these names.
"""

from __future__ import annotations

import pytest

from scheduler.serving.async_engine import AsyncEngine
from scheduler.serving.serve import load_engine, serve_config
from tests.serve_model import build_model_dir, load_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """A second copy of the model for the references (the server's runs in
    its own thread)."""
    return load_tiny(model_dir)


@pytest.fixture(scope="module")
def served(model_dir):
    # Imported here, not above: the server needs the serve extra (Starlette,
    # uvicorn), which the modules of this directory that serve nothing do not.
    from scheduler.serving.server import build_app
    from tests.scheduler.serving.test_server import ServerThread

    engine, name = load_engine(model_dir, serve_config(num_blocks=512, block_size=8))
    async_engine = AsyncEngine(engine, max_waiting=64)
    with ServerThread(build_app(async_engine, name)) as server:
        yield server, engine, name
