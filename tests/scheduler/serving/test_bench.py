"""`blockmgr bench` against `blockmgr serve` and `mlx_lm.server` on the same
tiny model directory (built locally, `tests/serve_model.py`).

References: the tokenizer's own chat template for the prompt tokens the
servers must report, the workload's output lengths (and mlx-lm's greedy
decode, to know that no output ends early at EOS), and for our server the
cached tokens the prefix trie must report when requests run one at a time:
the longest prefix shared with an earlier request's prompt and greedy output,
leaving the last prompt token to compute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from scheduler.cli import main  # noqa: E402
from scheduler.serving.async_engine import AsyncEngine  # noqa: E402
from scheduler.serving.loadgen import BenchOptions, PromptBuilder  # noqa: E402
from scheduler.serving.serve import load_engine, serve_config  # noqa: E402
from scheduler.serving.server import build_app  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.reference import greedy_reference  # noqa: E402
from tests.scheduler.serving.test_server import ServerThread  # noqa: E402
from tests.serve_model import build_model_dir, load_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 8
OUTPUT = 6
#: Chat and multi-turn sessions, one client at a time, on one system prompt.
WORKLOAD = ["--workload", "chat,multiturn", "-n", "8", "--arrival", "closed",
            "--concurrency", "1", "--num-system-prompts", "1", "--system-len", "fixed:24",
            "--user-len", "fixed:6", "--output-len", f"fixed:{OUTPUT}", "--turns", "fixed:3",
            "--think-time", "0", "--seed", "5", "--no-progress", "--no-plots"]


class MlxLmServer:
    """`mlx_lm.server` on a free loopback port, as a subprocess."""

    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
             "--port", str(self.port), "--log-level", "WARNING"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MlxLmServer:
        import urllib.request

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "mlx_lm.server exited"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise AssertionError("mlx_lm.server did not come up")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _bench(url: str, out: Path, *extra: str) -> dict:
    assert main(["bench", "--url", url, "--out", str(out), *WORKLOAD, *extra]) == 0
    return json.loads((out / "report.json").read_text())


def _sent(report: dict) -> list:
    """The requests of the report's workload, in session order."""
    from scheduler.simulator.config import SimulationConfig
    from scheduler.simulator.runner import sessions_of

    config = SimulationConfig.from_dict(report["config"])
    return [spec for session in sessions_of(config) for spec in session], config


def _prompt_ids(tokenizer, builder: PromptBuilder, spec) -> list[int]:
    return list(tokenizer.apply_chat_template(builder.messages(spec), add_generation_prompt=True))


def _cached_one_at_a_time(prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    """Prefix hits of requests run one by one (design/prefix_trie.md): the
    longest common prefix with an earlier request's computed tokens (its
    prompt and its output but the last token), at most the prompt's length - 1."""
    hits = []
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in (p + o[:-1] for p, o in zip(prompts[:i], outputs[:i])):
            n = 0
            while n < min(len(prompt), len(earlier)) and prompt[n] == earlier[n]:
                n += 1
            best = max(best, n)
        hits.append(min(best, len(prompt) - 1))
    return hits


def test_bench_against_blockmgr_serve_and_mlx_lm_server(tmp_path, capsys):
    model_dir = build_model_dir(tmp_path / "tiny")
    model, tokenizer = load_tiny(model_dir)
    engine, name = load_engine(model_dir, serve_config(num_blocks=512, block_size=BLOCK))
    with ServerThread(build_app(AsyncEngine(engine, max_waiting=64), name)) as server:
        ours = _bench(server.url, tmp_path / "ours")
        ours_poisson = _bench(server.url, tmp_path / "poisson", "--arrival", "poisson",
                              "--rate", "50")
    with MlxLmServer(model_dir) as mlx_server:
        theirs = _bench(mlx_server.url, tmp_path / "mlx", "--model", str(model_dir))

    eos = tokenizer.eos_token_id
    for report in (ours, ours_poisson, theirs):
        specs, config = _sent(report)
        builder = PromptBuilder(config.vocab_size, BenchOptions("http://unused"))
        prompts = [_prompt_ids(tokenizer, builder, spec) for spec in specs]
        assert len(specs) == 8 and {s.workload for s in specs} == {"chat", "multiturn"}
        for prompt in prompts:  # no greedy output ends early: every server returns OUTPUT tokens
            assert eos not in greedy_reference(model, prompt, OUTPUT)
        summary = report["summary"]
        assert summary["requests"]["finished"] == len(specs)
        assert summary["requests"]["aborted"] == 0 and summary["errors"] == {}
        assert summary["requests"]["usage_reported"] == len(specs)
        assert summary["requests"]["prompt_tokens"] == sum(len(p) for p in prompts)
        assert summary["requests"]["output_tokens"] == OUTPUT * len(specs)
        assert summary["latency"]["ttft_s"]["count"] == len(specs)
        assert summary["throughput"]["output_tokens_per_s"] > 0
        assert report["bench"]["api"] == "chat"

    # Our server, one request at a time: the trie's hits, page by page.
    specs, config = _sent(ours)
    builder = PromptBuilder(config.vocab_size, BenchOptions("http://unused"))
    prompts = [_prompt_ids(tokenizer, builder, spec) for spec in specs]
    outputs = [greedy_reference(model, prompt, OUTPUT) for prompt in prompts]
    expected = _cached_one_at_a_time(prompts, outputs)
    assert sum(expected) > 0
    assert ours["summary"]["prefix_cache"]["hit_tokens"] == sum(expected)
    assert ours["summary"]["requests"]["cached_tokens_reported"] == len(specs)
    assert ours["summary"]["prefix_cache"]["hit_rate"] == pytest.approx(
        sum(expected) / sum(len(p) for p in prompts))

    capsys.readouterr()
    assert main(["compare", str(tmp_path / "ours"), str(tmp_path / "mlx")]) == 0
    table = capsys.readouterr().out
    assert "throughput, output tok/s" in table and "n/a | n/a | n/a" in table
    assert (tmp_path / "ours" / "report.md").read_text().startswith("# blockmgr bench report")


@pytest.mark.parametrize("args, message", [
    (["--url", "http://127.0.0.1:9", "--prompt-format", "tokens"],
     "token-id prompts need the completions api"),
    (["--url", "127.0.0.1:9"], "url must start with http://"),
    (["--url", "http://127.0.0.1:9", "--write-trace", "t.jsonl"],
     "--write-trace applies to simulate"),
    (["--url", "http://127.0.0.1:9", "--time-scale", "0"], "must be a finite number > 0"),
])
def test_bench_bad_options_are_one_line(args, message, capsys):
    """Checked before any request is sent (nothing listens on port 9)."""
    assert main(["bench", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockmgr bench: error:") and message in err and err.count("\n") == 1


def test_bench_counts_a_refused_request_as_failed(tmp_path, capsys):
    """A server that answers 400 to everything: every request is counted
    failed with the server's message, and the command exits 1."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def refuse(request):
        return JSONResponse({"error": {"message": "no such thing"}}, status_code=400)

    app = Starlette(routes=[Route("/v1/chat/completions", refuse, methods=["POST"])])
    with ServerThread(app) as server:
        status = main(["bench", "--url", server.url + "/v1", "--model", "m", "--out",
                       str(tmp_path), *WORKLOAD])
    assert status == 1
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["requests"]["finished"] == 0 and summary["requests"]["aborted"] == 8
    assert summary["errors"] == {"HTTP 400: no such thing": 8}
    assert "8 of 8 requests failed" in capsys.readouterr().err
