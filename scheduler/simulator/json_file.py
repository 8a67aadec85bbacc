"""Reading the JSON files users hand the CLI (configs, reports, profiles)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, error: type[ValueError] = ValueError) -> Any:
    """The parsed file. Raises `error` naming `what` and the file when it
    cannot be read or is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path} is not JSON: {exc.msg}") from None
