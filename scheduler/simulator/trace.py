"""Trace files: a workload as JSON lines, written and replayed.

The first line may be a header, ``{"type": "header", "version": 1, ...}``,
carrying `vocab_size`, `prefix_block_tokens` and the generating workload's
settings (informational). Every other line is one request:

    id           request id (default: "r<line number>")
    arrival      absolute arrival, simulated seconds (alias: "timestamp",
                 milliseconds, as in Mooncake traces); omit for closed loop
    after        id of the request this one follows (its session); it then
                 arrives `think` seconds after that request finishes
    think        seconds (default 0)
    prompt       [[key, length], ...] text segments (see tokens.py), or
    prompt_tokens  explicit token ids, or
    prefix_ids   ids of shared prefix blocks (alias "hash_ids"), each
                 `prefix_block_tokens` tokens of text keyed by the id, then
                 unique text up to `prompt_len` (alias "input_length")
    output_len   tokens to generate (alias "output_length")
    output_key   the output text's key (default: derived from id)
    n, namespace, workload   optional

Requests must appear after the request they follow. Replay reads the whole
file (O(file size) memory); writing streams.

Prefix blocks: `prefix_block_tokens` comes from the caller (an override),
else from the header, else it is guessed as 512, the block Mooncake defines
its `hash_ids` over, with a `TraceWarning`. `time_scale` multiplies every
arrival and think time (0.5 replays the trace twice as fast).

CSV traces (`.csv`, a header row) are read by column name: arrival
(`arrival` seconds, `timestamp` ms, or Azure's `TIMESTAMP` date-time,
relative to the first row), prompt length (`input_length`, `prompt_len`,
`ContextTokens`, `context_tokens`) and output length (`output_length`,
`output_len`, `GeneratedTokens`, `generated_tokens`). Their prompts share
nothing (the columns carry no prefix information).
"""

from __future__ import annotations

import csv
import hashlib
import json
import warnings
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_int, check_number
from scheduler.simulator.tokens import derive_key
from scheduler.simulator.workloads import RequestSpec

TRACE_VERSION = 1
#: Tokens per `hash_ids` block in Mooncake traces (their FAST'25 release).
MOONCAKE_BLOCK_TOKENS = 512
_PREFIX_FAMILY = 0x9AEF1C5
_UNIQUE_FAMILY = 0x7E47


class TraceError(ValueError):
    """A trace file is malformed; the message names the line."""


class TraceWarning(UserWarning):
    """A trace was read with a guessed setting (its prefix block size)."""


def write_trace(path: str | Path, sessions: Iterable[list[RequestSpec]], header: dict) -> int:
    """Write sessions as JSONL (header first); returns the number of requests."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        head = {"type": "header", "version": TRACE_VERSION, **header}
        out.write(json.dumps(head, separators=(",", ":")) + "\n")
        for session in sessions:
            for spec in session:
                out.write(json.dumps(_record(spec), separators=(",", ":")) + "\n")
                count += 1
    return count


def _record(spec: RequestSpec) -> dict:
    record: dict = {"id": spec.request_id}
    if spec.arrival is not None:
        record["arrival"] = spec.arrival
    if spec.after is not None:
        record["after"] = spec.after
        record["think"] = spec.think_time
    elif spec.think_time:
        record["think"] = spec.think_time
    if spec.tokens is not None:
        record["prompt_tokens"] = list(spec.tokens)
    else:
        record["prompt"] = [list(segment) for segment in spec.prompt]
    record["output_len"] = spec.output_len
    record["output_key"] = spec.output_key
    if spec.n != 1:
        record["n"] = spec.n
    if spec.namespace is not None:
        record["namespace"] = spec.namespace
    record["workload"] = spec.workload
    return record


def read_trace(
    path: str | Path, prefix_block_tokens: int | None = None, time_scale: float = 1.0
) -> tuple[dict, list[list[RequestSpec]]]:
    """(header, sessions in file order). Raises `TraceError` naming the line.

    The returned header holds the `prefix_block_tokens` used (when any
    request has prefix ids) and `prefix_block_tokens_guessed`.
    """
    _check_replay_options(prefix_block_tokens, time_scale)
    try:
        handle = open(path, encoding="utf-8", newline="")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    with handle:
        if str(path).lower().endswith(".csv"):
            header, sessions = {}, _read_csv(handle, path)
        else:
            header, sessions = _read_jsonl(handle, path, prefix_block_tokens)
    if not sessions:
        raise TraceError(f"{path}: no requests")
    if time_scale != 1.0:
        sessions = [[_scaled(spec, time_scale) for spec in session] for session in sessions]
    return header, sessions


def _check_replay_options(prefix_block_tokens, time_scale) -> None:
    if prefix_block_tokens is not None:
        check_int("prefix_block_tokens", prefix_block_tokens, 1, strict=True)
    check_number("time_scale", time_scale, above=0.0)


def _scaled(spec: RequestSpec, scale: float) -> RequestSpec:
    return _copy(spec, arrival=None if spec.arrival is None else spec.arrival * scale,
                 think_time=spec.think_time * scale)


def _copy(s: RequestSpec, **changes: Any) -> RequestSpec:
    values: dict[str, Any] = dict(
        request_id=s.request_id, prompt=s.prompt, output_len=s.output_len,
        output_key=s.output_key, n=s.n, namespace=s.namespace, arrival=s.arrival,
        after=s.after, think_time=s.think_time, workload=s.workload, tokens=s.tokens,
    )
    values.update(changes)
    return RequestSpec(**values)


def _read_jsonl(handle, path, prefix_block_tokens: int | None):
    header: dict = {}
    blocks = _BlockSize(path, prefix_block_tokens)
    sessions: list[list[RequestSpec]] = []
    session_of: dict[str, list[RequestSpec]] = {}
    for lineno, line in enumerate(handle, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object")
        if record.get("type") == "header":
            if lineno != 1 and sessions:
                raise TraceError(f"{path}:{lineno}: header must be the first line")
            header = dict(record)
            blocks.header = header
            continue
        try:
            spec = _spec(record, lineno, blocks)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{lineno}: {_reason(exc)}") from None
        if spec.request_id in session_of:
            raise TraceError(f"{path}:{lineno}: duplicate request id {spec.request_id!r}")
        if spec.after is None:
            session = [spec]
            sessions.append(session)
        else:
            previous = session_of.get(spec.after)
            if previous is None or previous[-1].request_id != spec.after:
                raise TraceError(
                    f"{path}:{lineno}: 'after' must name the previous request of a "
                    f"session that appears earlier, got {spec.after!r}"
                )
            previous.append(spec)
            session = previous
        session_of[spec.request_id] = session
    if blocks.used is not None:
        header["prefix_block_tokens"] = blocks.used
        header["prefix_block_tokens_guessed"] = blocks.guessed
    return header, sessions


class _BlockSize:
    """The prefix block size of one read: decided at the first prefix-id
    request (option, else header, else a warned guess)."""

    def __init__(self, path, option: int | None) -> None:
        self.path = path
        self.option = option
        self.header: dict = {}
        self.used: int | None = None
        self.guessed = False

    def get(self) -> int:
        if self.used is None:
            self.used = self._decide()
        return self.used

    def _decide(self) -> int:
        if self.option is not None:
            return self.option
        if "prefix_block_tokens" in self.header:
            value = self.header["prefix_block_tokens"]
            return check_int("header prefix_block_tokens", value, 1, strict=True)
        self.guessed = True
        warnings.warn(TraceWarning(
            f"{self.path}: no header gives the prefix block size; reading hash_ids as "
            f"{MOONCAKE_BLOCK_TOKENS}-token blocks (Mooncake's); set it with --trace-block-tokens"
        ), stacklevel=4)
        return MOONCAKE_BLOCK_TOKENS


_CSV_ARRIVAL = ("arrival", "timestamp", "TIMESTAMP")
_CSV_PROMPT = ("input_length", "prompt_len", "ContextTokens", "context_tokens")
_CSV_OUTPUT = ("output_length", "output_len", "GeneratedTokens", "generated_tokens")


def _read_csv(handle, path) -> list[list[RequestSpec]]:
    """ShareGPT-style / Azure LLM inference CSV rows, one request each."""
    reader = csv.DictReader(handle)
    columns = reader.fieldnames or []
    names = [_column(columns, options, path)
             for options in (_CSV_ARRIVAL, _CSV_PROMPT, _CSV_OUTPUT)]
    sessions = []
    start = None
    for lineno, row in enumerate(reader, 2):
        try:
            when = _csv_time(names[0], row[names[0]])
            start = when if start is None else start
            request_id = f"r{lineno}"
            spec = RequestSpec(
                request_id,
                ((derive_key(_UNIQUE_FAMILY ^ _id_hash(request_id), 0), int(row[names[1]])),),
                int(row[names[2]]),
                derive_key(_id_hash(request_id), 1),
                arrival=max(when - start, 0.0),
                workload="trace",
            )
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{lineno}: {exc}") from None
        sessions.append([spec])
    return sessions


def _column(columns: Sequence[str], options: tuple[str, ...], path) -> str:
    for name in options:
        if name in columns:
            return name
    raise TraceError(f"{path}:1: CSV trace needs one of the columns {', '.join(options)}")


def _csv_time(column: str, text: str) -> float:
    """Seconds: `arrival` is seconds, `timestamp` ms, `TIMESTAMP` a date-time."""
    if column == "arrival":
        return float(text)
    if column == "timestamp":
        return float(text) / 1000.0
    stamp = text.strip()
    head, dot, fraction = stamp.partition(".")
    if dot:  # Azure writes 7 fractional digits; datetime takes 6
        stamp = f"{head}.{fraction[:6]}"
    return datetime.fromisoformat(stamp).timestamp()


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    return str(exc)


def _spec(record: dict, lineno: int, blocks: "_BlockSize") -> RequestSpec:
    request_id = str(record.get("id", f"r{lineno}"))
    arrival = record.get("arrival")
    if arrival is None and "timestamp" in record:
        arrival = float(record["timestamp"]) / 1000.0
    output_len = int(_first(record, "output_len", "output_length"))
    output_key = record.get("output_key")
    if output_key is None:
        output_key = derive_key(_id_hash(request_id), 1)
    namespace = record.get("namespace")
    if namespace is not None and not isinstance(namespace, (str, int)):
        raise InvalidArgument(f"namespace must be a string or an integer, got {namespace!r}")
    prompt, tokens = _prompt(record, request_id, blocks)
    return RequestSpec(
        request_id,
        prompt,
        output_len,
        int(output_key),
        n=int(record.get("n", 1)),
        namespace=namespace,
        arrival=None if arrival is None else float(arrival),
        after=record.get("after"),
        think_time=float(record.get("think", 0.0)),
        workload=str(record.get("workload", "trace")),
        tokens=tokens,
    )


def _id_hash(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def _first(record: dict, *names: str):
    for name in names:
        if name in record:
            return record[name]
    raise KeyError(names[0])


def _prompt(record: dict, request_id: str, blocks: "_BlockSize"):
    if "prompt_tokens" in record:
        tokens = record["prompt_tokens"]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise InvalidArgument("prompt_tokens must be a list of non-negative ints")
        return (), tuple(tokens)
    if "prompt" in record:
        segments = []
        for item in record["prompt"]:
            key, length = item
            if int(length) < 1:
                raise InvalidArgument("prompt segment lengths must be >= 1")
            segments.append((int(key), int(length)))
        return tuple(segments), None
    ids = record.get("prefix_ids", record.get("hash_ids"))
    if ids is None:
        raise KeyError("prompt")
    prompt_len = int(_first(record, "prompt_len", "input_length"))
    return _prefix_segments(ids, prompt_len, request_id, blocks.get()), None


def _prefix_segments(ids, prompt_len: int, request_id: str, block: int):
    """Shared blocks keyed by prefix id (the last may be cut), then unique text."""
    segments = []
    room = prompt_len
    for prefix_id in ids:
        if room <= 0:
            break
        length = min(block, room)
        segments.append((derive_key(_PREFIX_FAMILY, int(prefix_id)), length))
        room -= length
    if room > 0:
        unique = derive_key(_UNIQUE_FAMILY ^ _id_hash(request_id), 0)
        segments.append((unique, room))
    return tuple(segments)


def iter_sessions(sessions: list[list[RequestSpec]]) -> Iterator[list[RequestSpec]]:
    """Fresh copies of replayed sessions (the runner may annotate specs)."""
    for session in sessions:
        yield [_copy(s) for s in session]
