"""`setting`: a config field declared once, with its default and the help
the command line shows (`scheduler.engine.config.settings()` reads them
and `scheduler.cli` builds every subcommand's options from them). Pure
Python, no MLX: the scheduling core's configs use it too."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, *, none: str | None = None, more: str | None = None,
            option: str | None = None, old: tuple[str, ...] = (), metavar: str | None = None,
            minimum: int | float | None = None, choices: tuple[Any, ...] | None = None) -> Any:
    """A config field declared with its default and its help (the CLI's
    text: "HELP (default X): MORE"); `none`: what a default of None means;
    `option` when the option is not ``--`` + the field's name with dashes;
    `old` spellings still accepted; `minimum`/`choices` for the CLI's
    parsing (the config's own validation is the authority)."""
    meta = {"help": help, "none": none, "more": more, "option": option, "old": old,
            "metavar": metavar, "minimum": minimum, "choices": choices}
    return field(default=default, metadata=meta)
