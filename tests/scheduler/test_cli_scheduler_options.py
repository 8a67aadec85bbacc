"""The scheduler's settings on the command line: one name per setting
(vLLM's), the same in every subcommand that takes it, help that states
`SchedulerConfig`'s default, and the older spellings still accepted with a
deprecation line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import pytest

from scheduler import cli
from scheduler.core.scheduler import SchedulerConfig

#: `SchedulerConfig` field -> its option (vLLM's spelling).
OPTIONS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "policy": "--policy",
    "preemption": "--preemption",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "max_num_partial_prefills": "--max-num-partial-prefills",
}
#: The spellings before, still accepted.
OLD = {
    "--max-batched-tokens": ("--max-num-batched-tokens", "max_num_batched_tokens", "512"),
    "--long-prefill-threshold": ("--long-prefill-token-threshold",
                                 "long_prefill_token_threshold", "96"),
    "--max-partial-prefills": ("--max-num-partial-prefills", "max_num_partial_prefills", "3"),
}


def help_of(command: str) -> str:
    """`blockmgr COMMAND --help`, on one line (argparse wraps at any width)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    return " ".join(out.getvalue().split())


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_every_scheduler_setting_has_its_vllm_name_and_default_in_help(command):
    text = help_of(command)
    group = text[text.index("scheduler: --max-num-seqs"):]  # the group's options, not the usage
    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    for field, option in OPTIONS.items():
        assert option in text, f"{command} lacks {option}"
        default = defaults[field]
        stated = "none" if field == "long_prefill_token_threshold" else (
            "no limit" if field == "max_num_partial_prefills" else str(default))
        assert re.search(re.escape(option) + r" .{0,80}?\(default:? " + re.escape(stated), group), \
            f"{option}'s help does not state the default {stated}"
    for old in OLD:
        assert old not in text  # hidden: the help shows one name per setting


def test_serve_names_its_scheduler_settings_as_simulate_does():
    serve, simulate = help_of("serve"), help_of("simulate")
    for option in ("--max-num-seqs", "--max-num-batched-tokens"):
        assert option in serve and option in simulate


@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_spelling_gives_the_same_config_and_one_deprecation_line(old, capsys):
    new, field, value = OLD[old]
    parser = cli.build_parser()
    with_new = cli.build_config(parser.parse_args(["simulate", new, value]))
    assert capsys.readouterr().err == ""
    with_old = cli.build_config(parser.parse_args(["simulate", old, value]))
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"blockmgr: {old} is deprecated; use {new}"]
    assert getattr(with_old.scheduler, field) == getattr(with_new.scheduler, field) == int(value)
    assert with_old == with_new
