"""Fixtures shared by the scheduler's tests."""

from __future__ import annotations

import pytest

from tests.scheduler.test_engine import BUILDERS


@pytest.fixture(params=sorted(BUILDERS))
def name(request):
    """Each tiny model of `tests.scheduler.test_engine` (its `get(name)`)."""
    return request.param
