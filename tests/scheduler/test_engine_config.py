"""`EngineConfig`: every engine setting declared once, the engine built
from it as from the flat keywords, and the command line's options of
simulate, replay, calibrate, serve and bench agreeing with the
declarations (one name per setting, vLLM's where vLLM has one, the help
and the default each command states, old spellings hidden)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from blockmgr.errors import InvalidArgument
from scheduler import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig, cli
from scheduler.engine.config import settings
from scheduler.serving.serve import SERVE_DEFAULTS
from scheduler.simulator.config import SimulationConfig
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak
from tests.tiny_models import ATTENTION_VOCAB, built

COMMANDS = ("simulate", "replay", "calibrate", "serve", "bench")

#: vLLM's option for each setting vLLM has (vllm/engine/arg_utils.py).
VLLM_NAMES = {
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "max_num_partial_prefills": "--max-num-partial-prefills",
    "max_model_len": "--max-model-len",
    "num_speculative_tokens": "--num-speculative-tokens",
}

#: Settings each command takes (its options, visible in its help).
TAKEN = {
    "simulate": {"num_blocks", "block_size", "num_slots", "enable_prefix_cache", "watermark",
                 "num_host_blocks", "num_host_slots", "kv_bits", "kv_group_size",
                 *cli.SCHEDULER_OPTIONS},
    "replay": {"num_blocks", "block_size", "num_slots", "enable_prefix_cache", "watermark",
               "num_host_blocks", "num_host_slots", *cli.SCHEDULER_OPTIONS},
    "calibrate": {"disk_cache"},
    "serve": {"num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "policy",
              "long_prefill_token_threshold", "max_num_partial_prefills", "prefill_batch",
              "max_model_len", "num_speculative_tokens", "kv_bits", "kv_group_size",
              "disk_cache", "disk_cache_size", "host_cache_size"},
    "bench": {"vocab_size"},
}
#: A command's own use of a setting's name, and words its help must say:
#: calibrate times the disk serve's --disk-cache will use; bench draws
#: token ids below the server's vocabulary size.
OTHER_USE = {("calibrate", "disk_cache"): "serve --disk-cache",
             ("bench", "vocab_size"): "server's vocabulary"}


def subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    # argparse's own private names: the standard library has no public call listing actions
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def options_of(command: str) -> dict[str, argparse.Action]:
    """Option string -> action, hidden ones included."""
    # argparse's `_actions`: `--help` text would miss the hidden (deprecated) options
    return {opt: action for action in subparser(command)._actions
            for opt in action.option_strings}


SETTINGS = settings()
BY_OPTION = {s.option: s for s in SETTINGS.values()}
OLD = {old: s for s in SETTINGS.values() for old in s.old}


# ------------------------------------------------------------ declarations


def test_every_setting_is_declared_once_with_help():
    parts = {"cache": CacheConfig, "scheduler": SchedulerConfig, "engine": EngineConfig}
    for name, s in SETTINGS.items():
        fields = {f.name: f for f in dataclasses.fields(parts[s.part])}
        assert fields[name].default == s.default  # the default is the config's own
        assert s.help and s.option.startswith("--")
    for f in dataclasses.fields(SchedulerConfig):  # declared with its help on the core's own field
        assert f.metadata["help"] == SETTINGS[f.name].help
    assert len(BY_OPTION) == len(SETTINGS)  # one option per setting, none shared
    assert not set(OLD) & set(BY_OPTION)
    for name, option in VLLM_NAMES.items():
        assert SETTINGS[name].option == option


def test_flat_keywords_go_to_the_part_that_declares_them():
    config = EngineConfig.of(num_blocks=64, block_size=8, kv_bits=8, max_num_seqs=3,
                             policy="priority", prefill_batch=2, num_speculative_tokens=2)
    assert config.cache == CacheConfig(num_blocks=64, block_size=8, kv_bits=8)
    assert config.scheduler == SchedulerConfig(max_num_seqs=3, policy="priority")
    assert (config.prefill_batch, config.num_speculative_tokens) == (2, 2)
    assert EngineConfig.of(scheduler_config=SchedulerConfig(max_num_seqs=5)).scheduler \
        == SchedulerConfig(max_num_seqs=5)
    with pytest.raises(InvalidArgument, match="not both"):
        EngineConfig.of(scheduler_config=SchedulerConfig(), max_num_seqs=2)
    with pytest.raises(TypeError, match="num_pages"):
        EngineConfig.of(num_pages=3)
    with pytest.raises(TypeError, match="CacheConfig"):
        EngineConfig(cache=SchedulerConfig())  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.prefill_batch = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad", [
    {"num_blocks": 0}, {"block_size": -1}, {"num_slots": -1}, {"watermark": 1.0},
    {"enable_prefix_cache": "yes"}, {"prefill_batch": 0}, {"prefill_batch": True},
    {"max_forward_retries": 0}, {"num_speculative_tokens": 0}, {"vocab_size": 0},
    {"max_num_seqs": 0}, {"policy": "lifo"},
])
def test_bad_settings_are_refused_before_anything_is_built(bad):
    with pytest.raises(ValueError):
        EngineConfig.of(**bad)
    with pytest.raises(ValueError):
        Engine(built("llama"), **bad)


# ------------------------------------------------------------------ engine


def test_an_engine_from_a_config_is_the_engine_of_the_keywords():
    model = built("llama")
    prompts = [[(5 * i + k) % ATTENTION_VOCAB for i in range(7 + k)] for k in range(4)]
    want = [greedy_reference(model, p, 5) for p in prompts]
    keywords = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 3,
                "max_num_batched_tokens": 24, "prefill_batch": 2}
    given = EngineConfig.of(**keywords)
    by_config = Engine(model, config=given)
    by_keywords = Engine(model, **keywords)
    assert by_config.config == by_keywords.config
    assert given.scheduler.max_model_len is None  # the caller's config is left as it was
    assert by_config.config.scheduler.max_model_len == 64 * 4  # resolved: what the pool holds
    assert by_config.scheduler.config == by_config.config.scheduler
    for engine in (by_config, by_keywords):
        outs = engine.generate(prompts, SamplingParams(max_tokens=5))
        assert [o.tokens for o in outs] == want
        assert_no_leak(engine)


def test_config_and_setting_keywords_together_are_refused():
    model = built("llama")
    with pytest.raises(InvalidArgument, match="num_blocks"):
        Engine(model, 64, config=EngineConfig())
    with pytest.raises(InvalidArgument, match="max_num_seqs"):
        Engine(model, config=EngineConfig(), max_num_seqs=2)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(model, config={"num_blocks": 64})
    with pytest.raises(TypeError, match="num_pages"):
        Engine(model, num_pages=64)


# -------------------------------------------------------------------- CLI


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_setting_options_come_from_the_declarations(command):
    options = options_of(command)
    visible = {opt for opt, a in options.items() if a.help is not argparse.SUPPRESS}
    taken = {BY_OPTION[opt].name for opt in visible if opt in BY_OPTION}
    assert taken == TAKEN[command]
    assert not visible & set(OLD)  # old spellings are hidden
    for opt in visible & set(BY_OPTION):
        s, action = BY_OPTION[opt], options[opt]
        assert action.option_strings == [s.option]  # one name
        if (command, s.name) in OTHER_USE:
            assert OTHER_USE[command, s.name] in action.help
        else:
            assert s.help in action.help  # the declared help
        for old in s.old:  # accepted, stored where the option stores
            assert options[old].dest == action.dest and options[old].help is argparse.SUPPRESS


def stated_default(help_text: str) -> str:
    start = help_text.index("(default") + len("(default")
    return help_text[start:help_text.index(")", start)].lstrip(": ").strip()


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_simulate_and_replay_state_and_apply_the_simulations_defaults(command):
    options = options_of(command)
    base = SimulationConfig()
    args = ["simulate"] if command == "simulate" else ["replay", "--preset", "qwen3-0.6b"]
    config = cli.build_config(cli.build_parser().parse_args(args))
    assert config.scheduler == base.scheduler and config.block_manager == base.block_manager
    for name in TAKEN[command] - {"kv_bits", "kv_group_size", "enable_prefix_cache"}:
        s = SETTINGS[name]
        part = base.scheduler if s.part == "scheduler" else base.block_manager
        value = getattr(part, name)
        if name in ("num_slots", "num_host_blocks", "num_host_slots"):
            continue  # rules (with --hybrid, with swap), not values
        shown = s.none if value is None else (f"{value:g}" if isinstance(value, float)
                                              else str(value))
        assert stated_default(options[s.option].help) == shown, name


def test_serve_states_and_applies_the_engines_defaults_but_those_it_changes():
    options = options_of("serve")
    args = cli.build_parser().parse_args(["serve", "--model", "DIR"])
    applied = cli.serve_settings(args)
    assert "num_blocks" not in applied and "max_model_len" not in applied  # rules of serve
    engine_config = EngineConfig.of(**applied)
    assert engine_config == EngineConfig.of(**SERVE_DEFAULTS)  # the engine's, but those
    assert SERVE_DEFAULTS and all(  # serve's own, each a change
        SETTINGS[name].default != value for name, value in SERVE_DEFAULTS.items())
    for name in TAKEN["serve"] - {"num_blocks", "max_model_len"}:
        s = SETTINGS[name]
        value = SERVE_DEFAULTS.get(name, s.default)
        shown = s.none if value is None else str(value)
        assert stated_default(options[s.option].help) == shown, name
        if s.part != "cache" or name == "block_size":
            assert getattr(args, name) == value
    assert args.num_speculative_tokens == EngineConfig().num_speculative_tokens


def test_bench_applies_simulates_pool_and_scheduler_defaults():
    parser = cli.build_parser()
    bench = vars(parser.parse_args(["bench", "--url", "http://x"]))
    simulate = vars(parser.parse_args(["simulate"]))
    for name in TAKEN["simulate"]:
        dest = "no_prefix_cache" if name == "enable_prefix_cache" else name
        assert bench[dest] == simulate[dest], name


@pytest.mark.parametrize("command", ["simulate", "serve"])
def test_an_old_spelling_sets_the_same_option_with_one_deprecation_line(command, capsys):
    head = ["serve", "--model", "DIR"] if command == "serve" else ["simulate"]
    parser = cli.build_parser()
    for old, s in OLD.items():
        if s.name not in TAKEN[command]:
            continue
        new_args = parser.parse_args(head + [s.option, "7"])
        assert capsys.readouterr().err == ""
        old_args = parser.parse_args(head + [old, "7"])
        assert capsys.readouterr().err.strip() == f"blockmgr: {old} is deprecated; use {s.option}"
        assert vars(old_args) == vars(new_args)
