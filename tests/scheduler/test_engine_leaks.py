"""`Engine.check_no_leaks`: no request left, and only the prefix cache holds
storage (`PagedCache.check_no_leaks`, tests/cache/test_check_no_leaks.py)."""

from __future__ import annotations

import pytest

from blockmgr.errors import IntegrityError
from scheduler import Engine, SamplingParams
from tests.tiny_models import built


def test_an_engine_with_work_left_or_done():
    engine = Engine(built("llama"), num_blocks=32, block_size=8, max_num_seqs=2)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(IntegrityError, match="1 waiting"):
        engine.check_no_leaks()
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
