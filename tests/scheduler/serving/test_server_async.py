"""`AsyncEngine` without HTTP: concurrent `async for` over requests equals
`Engine.generate`, cancellation aborts and frees, bad requests raise the
engine's typed errors, a raising step ends the live requests only."""

from __future__ import annotations

import asyncio

import pytest

from blockmgr.errors import InvalidArgument
from scheduler import Engine, SamplingParams
from scheduler.serving.async_engine import AsyncEngine, EngineStopped
from tests.serve_model import build_model_dir

PROMPTS = ["Hello world", "The quick brown fox", "A prefix trie", "Streams of"]


def _engine(tiny):
    model, tok = tiny
    return Engine(model, num_blocks=128, block_size=8, tokenizer=tok)


async def _text(engine: AsyncEngine, prompt, params) -> str:
    parts = []
    async for out in engine.generate(prompt, params):
        parts.append((out.new_text or {}).get(0, ""))  # None: an output with no text
    return "".join(parts)


async def _all_texts(engine: AsyncEngine, params) -> list[str]:
    return await asyncio.gather(*(_text(engine, p, params) for p in PROMPTS))


def test_concurrent_async_requests_equal_generate(tiny):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.text for o in _engine(tiny).generate(PROMPTS, params)]
    engine = AsyncEngine(_engine(tiny))
    engine.start()
    try:
        assert asyncio.run(_all_texts(engine, params)) == want
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_cancelling_a_request_aborts_it_and_frees_its_pages(tiny):
    inner = _engine(tiny)
    free = inner.cache.num_free_blocks + inner.cache.num_cached_blocks
    engine = AsyncEngine(inner)
    engine.start()
    try:
        async def main():
            seen = asyncio.Event()

            async def long_request():
                params = SamplingParams(max_tokens=900, ignore_eos=True)
                async for _ in engine.generate("Hello", params):
                    seen.set()

            task = asyncio.create_task(long_request())
            await asyncio.wait_for(seen.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(1000):  # the engine thread takes the abort
                if not inner.has_unfinished():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the request was not aborted")

        asyncio.run(main())
    finally:
        engine.shutdown()
    assert inner.stats.num_generated_tokens < 900
    assert inner.cache.block_manager.num_sequences == 0
    assert inner.cache.num_free_blocks + inner.cache.num_cached_blocks == free
    inner.check_integrity()


def test_the_first_request_starts_the_engine_and_none_is_taken_after_shutdown(tiny):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    (want,) = _engine(tiny).generate(["Hello"], params)
    engine = AsyncEngine(_engine(tiny))  # no start(): the first request starts it
    assert not engine.is_running
    try:
        assert asyncio.run(_text(engine, "Hello", params)) == want.text
        assert engine.is_running
    finally:
        engine.shutdown()

    async def add_after_shutdown():
        await engine.add("x")

    with pytest.raises(EngineStopped):
        asyncio.run(add_after_shutdown())


def test_reset_prefix_cache_drops_the_cached_pages_and_a_rerun_hits_nothing(tiny):
    inner = _engine(tiny)
    engine = AsyncEngine(inner)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = PROMPTS[1] * 4  # several full pages

    async def main():
        await _text(engine, prompt, params)
        cached = inner.cache.num_cached_blocks
        freed = await engine.reset_prefix_cache()
        after = inner.cache.num_cached_blocks
        return cached, freed, after

    try:
        cached, freed, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert cached > 0
    assert after == 0
    assert freed == cached
    assert inner.cache.num_free_blocks == inner.cache.store.config.num_blocks
    inner.check_integrity()

    async def reset_after_shutdown():
        await engine.reset_prefix_cache()

    with pytest.raises(EngineStopped):
        asyncio.run(reset_after_shutdown())


def test_bad_requests_raise_typed_errors_and_the_loop_goes_on(tiny):
    engine = AsyncEngine(_engine(tiny))
    try:
        async def main():
            with pytest.raises(InvalidArgument, match="empty"):
                await engine.add("")
            with pytest.raises(InvalidArgument, match="role"):
                await engine.add([{"content": "x"}])
            return await _text(engine, "Hello", SamplingParams(max_tokens=3, ignore_eos=True))

        (want,) = _engine(tiny).generate(["Hello"], SamplingParams(max_tokens=3,
                                                                    ignore_eos=True))
        assert asyncio.run(main()) == want.text
    finally:
        engine.shutdown()


def test_a_raising_step_ends_the_live_requests_with_its_error(tiny):
    inner = _engine(tiny)
    engine = AsyncEngine(inner)
    calls = {"n": 0}
    real_step = inner.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    inner.step = failing_step
    engine.start()
    try:
        async def main():
            with pytest.raises(RuntimeError, match="injected"):
                await _text(engine, "Hello", SamplingParams(max_tokens=20, ignore_eos=True))
            return await _text(engine, "Hello", SamplingParams(max_tokens=4, ignore_eos=True))

        (want,) = _engine(tiny).generate(["Hello"], SamplingParams(max_tokens=4,
                                                                    ignore_eos=True))
        assert asyncio.run(main()) == want.text
    finally:
        engine.shutdown()
    assert inner.cache.block_manager.num_sequences == 0
    inner.check_integrity()


def test_a_raising_status_sink_leaves_every_request_correct(tiny):
    from scheduler.serving.status import StatusLine

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.text for o in _engine(tiny).generate(PROMPTS, params)]
    lines = []

    def sink(line):
        lines.append(line)
        raise RuntimeError("the log is gone")

    engine = AsyncEngine(_engine(tiny), status=StatusLine(1e-9), status_sink=sink)
    try:
        assert asyncio.run(_all_texts(engine, params)) == want
    finally:
        engine.shutdown()
    assert lines  # it was called (and raised) while the requests ran
    engine.engine.check_integrity()


def test_a_script_that_used_an_async_engine_exits_cleanly(tmp_path):
    """The engine thread clears its MLX streams before it ends: without it a
    script's exit aborted ("terminate called without an active exception")
    one run in three, more on a loaded machine."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    model_dir = build_model_dir(tmp_path / "tiny")
    script = (
        "import asyncio, mlx_lm\n"
        "from scheduler import AsyncEngine, Engine, SamplingParams\n"
        f"model, tok = mlx_lm.load({str(model_dir)!r})\n"
        "engine = AsyncEngine(Engine(model, num_blocks=64, tokenizer=tok))\n"
        "async def main():\n"
        "    async for _ in engine.generate(tok.encode('Hello'), SamplingParams(max_tokens=8)):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "engine.shutdown()\n")
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
        assert done.returncode == 0, done.stderr
