"""`served_sessions`: the bench's requests as a server tokenizes them, what
the simulated fleet of benchmarks/fleet_predict.py replays. Checked against
the chat template rendered by hand and encoded by the tokenizer alone, and
through a simulated fleet: every request the bench sends, once, with the
server's prompt lengths."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from scheduler.engine.text import TextCodec
from scheduler.serving.loadgen import BenchOptions, PromptBuilder, prompt_text, served_sessions
from scheduler.simulator import SimulationConfig, WorkloadConfig
from scheduler.simulator.fleet import FleetSpec, run_fleet
from scheduler.simulator.lengths import LengthDist
from scheduler.simulator.workloads import generate
from tests.serve_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return load_tokenizer(path)


def workload() -> WorkloadConfig:
    return WorkloadConfig(mix={"multiturn": 1.0}, num_requests=24, arrival="closed",
                          concurrency=3, seed=2, think_time=0.0, num_system_prompts=2,
                          system_len=LengthDist("fixed", 40), user_len=LengthDist("fixed", 9),
                          output_len=LengthDist("fixed", 5), turns=LengthDist("fixed", 3))


def by_hand(messages: list[dict]) -> str:
    """tests/serve_model.py's template, written out."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


def test_chat_prompts_are_the_template_of_what_the_bench_sends(tokenizer):
    sessions = list(generate(workload()))
    builder = PromptBuilder(32000, BenchOptions("http://x", model="m"))
    served = served_sessions(sessions, builder, TextCodec(tokenizer).encode)
    assert [[s.request_id for s in session] for session in served] == \
        [[s.request_id for s in session] for session in sessions]
    for session, served_session in zip(sessions, served):
        for spec, got in zip(session, served_session):
            text = by_hand(builder.messages(spec))
            assert list(got.tokens) == tokenizer.encode(text, add_special_tokens=False)
            # one message per segment: system, then user and assistant in turn
            assert text.count("<|") == len(spec.prompt) + 1
            assert (got.after, got.think_time, got.output_len, got.output_key, got.n,
                    got.arrival, got.namespace) == \
                (spec.after, spec.think_time, spec.output_len, spec.output_key, spec.n,
                 spec.arrival, spec.namespace)


def test_completion_prompts_are_the_ids_or_the_text_sent(tokenizer):
    sessions = list(generate(workload()))
    ids = PromptBuilder(32000, BenchOptions("http://x", api="completions",
                                            prompt_format="tokens"))
    for session, served_session in zip(sessions, served_sessions(sessions, ids, None)):
        for spec, got in zip(session, served_session):
            assert list(got.tokens) == ids.tokens.expand(spec.prompt)
    text = PromptBuilder(32000, BenchOptions("http://x", api="completions"))
    codec = TextCodec(tokenizer)
    spec = sessions[0][0]
    (got,) = served_sessions([[spec]], text, codec.encode)[0]
    assert list(got.tokens) == tokenizer.encode(prompt_text(text.tokens.expand(spec.prompt)),
                                                add_special_tokens=False)


def test_a_simulated_fleet_replays_every_request_sent_once(tokenizer):
    config = SimulationConfig(workload=workload(), check_every=None)
    sessions = list(generate(config.workload))
    builder = PromptBuilder(config.vocab_size, BenchOptions("http://x", model="m"))
    served = served_sessions(sessions, builder, TextCodec(tokenizer).encode)
    result = run_fleet(config, FleetSpec(3, "cache_aware"), served)
    assert sorted(result.routes) == sorted(s.request_id for session in sessions for s in session)
    lengths = sorted(len(s.tokens) for session in served for s in session)
    got = sorted(int(n) for r in result.replicas
                 for n in r.metrics.request_arrays()["prompt_tokens"])
    assert got == lengths
    # A follow-up quotes the workload's answer, not what the replica generated:
    # it hits its previous turn's prompt, not the answer after it, so less
    # than the workload's own prompts do (their answers are the simulated ones).
    own = run_fleet(config, FleetSpec(3, "cache_aware"), sessions)
    served_rate = result.summary["prefix_cache"]["first_admission_hit_rate"]
    assert 0.3 < served_rate < own.summary["prefix_cache"]["first_admission_hit_rate"]
