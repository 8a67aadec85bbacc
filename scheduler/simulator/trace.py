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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from scheduler.simulator.tokens import derive_key
from scheduler.simulator.workloads import RequestSpec

TRACE_VERSION = 1
DEFAULT_PREFIX_BLOCK_TOKENS = 16
_PREFIX_FAMILY = 0x9AEF1C5
_UNIQUE_FAMILY = 0x7E47


class TraceError(ValueError):
    """A trace file is malformed; the message names the line."""


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


def read_trace(path: str | Path) -> tuple[dict, list[list[RequestSpec]]]:
    """(header, sessions in file order). Raises `TraceError` naming the line."""
    header: dict = {}
    sessions: list[list[RequestSpec]] = []
    session_of: dict[str, list[RequestSpec]] = {}
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    with handle:
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
                header = record
                continue
            try:
                spec = _spec(record, lineno, header)
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: {_reason(exc)}") from None
            if spec.request_id in session_of:
                raise TraceError(f"{path}:{lineno}: duplicate request id {spec.request_id!r}")
            if spec.after is None:
                session = [spec]
                sessions.append(session)
            else:
                session = session_of.get(spec.after)
                if session is None or session[-1].request_id != spec.after:
                    raise TraceError(
                        f"{path}:{lineno}: 'after' must name the previous request of a "
                        f"session that appears earlier, got {spec.after!r}"
                    )
                session.append(spec)
            session_of[spec.request_id] = session
    if not sessions:
        raise TraceError(f"{path}: no requests")
    return header, sessions


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    return str(exc)


def _spec(record: dict, lineno: int, header: dict) -> RequestSpec:
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
        raise ValueError(f"namespace must be a string or an integer, got {namespace!r}")
    prompt, tokens = _prompt(record, request_id, header)
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


def _prompt(record: dict, request_id: str, header: dict):
    if "prompt_tokens" in record:
        tokens = record["prompt_tokens"]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise ValueError("prompt_tokens must be a list of non-negative ints")
        return (), tuple(tokens)
    if "prompt" in record:
        segments = []
        for item in record["prompt"]:
            key, length = item
            if int(length) < 1:
                raise ValueError("prompt segment lengths must be >= 1")
            segments.append((int(key), int(length)))
        return tuple(segments), None
    ids = record.get("prefix_ids", record.get("hash_ids"))
    if ids is None:
        raise KeyError("prompt")
    return _prefix_segments(ids, int(_first(record, "prompt_len", "input_length")), request_id, header), None


def _prefix_segments(ids, prompt_len: int, request_id: str, header: dict):
    """Shared blocks keyed by prefix id (the last may be cut), then unique text."""
    block = int(header.get("prefix_block_tokens", DEFAULT_PREFIX_BLOCK_TOKENS))
    if block < 1:
        raise ValueError("prefix_block_tokens must be >= 1")
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
        yield [
            RequestSpec(
                s.request_id, s.prompt, s.output_len, s.output_key, s.n, s.namespace,
                s.arrival, s.after, s.think_time, s.workload, s.tokens,
            )
            for s in session
        ]
