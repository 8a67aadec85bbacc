"""A fleet on this machine: `blockmgr serve` replicas behind the Shepherd
Model Gateway (`smg launch`), as processes on free loopback ports.

`Fleet(model_dir, num_replicas, policy, tmp)` starts the replicas (each
with its own log file), waits until each answers /health, then starts
`smg launch --worker-urls ... --policy POLICY` and waits until the gateway
lists every replica as ready. With `grpc=True` each replica also serves
the gateway's gRPC worker service (`--grpc-port`) and the gateway is given
those `grpc://` URLs: it routes on token ids and reads the replicas' KV
events (event-driven `cache_aware`). Leaving the block stops every process it
started (SIGTERM, then SIGKILL after a bounded wait), whatever happened.
Used by tests/test_fleet_gateway.py and benchmarks/fleet_gateway.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tests.ports import free_port

try:  # the HTTP client the openai package uses (httpx before openai 3)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


def smg_binary() -> str | None:
    """The `smg` console script of this environment (the `fleet` extra), or None."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


class Fleet:
    """The processes of the module doc; `url` is the gateway's, `replica_urls`
    the replicas' own (to read their /metrics)."""

    def __init__(self, model_dir: Path, num_replicas: int, policy: str, logs: Path, *,
                 serve_args: tuple[str, ...] = (), smg_args: tuple[str, ...] = (),
                 timeout: float = 120.0, grpc: bool = False) -> None:
        self.model_dir, self.num_replicas, self.policy = model_dir, num_replicas, policy
        self.logs, self.serve_args, self.smg_args = logs, serve_args, smg_args
        self.timeout = timeout
        self.grpc = grpc
        self.procs: list[subprocess.Popen] = []
        self.files: list[IO[str]] = []
        self.replica_urls: list[str] = []
        self.worker_urls: list[str] = []  # what the gateway is given (gRPC ones with grpc)
        self.url = ""
        self.metrics_url = ""  # the gateway's Prometheus endpoint

    def __enter__(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def replica_log(self, index: int) -> str:
        return (self.logs / f"replica-{index}.log").read_text()

    def gateway_log(self) -> str:
        return (self.logs / "smg.log").read_text()

    def _spawn(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        out = open(self.logs / log_name, "w")  # noqa: SIM115 - closed in stop()
        self.files.append(out)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs.append(proc)
        return proc

    def _start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        replicas = []
        for i in range(self.num_replicas):
            port = free_port()
            self.replica_urls.append(f"http://{LOOPBACK}:{port}")
            grpc_args: tuple[str, ...] = ()
            if self.grpc:
                grpc_port = free_port()
                grpc_args = ("--grpc-port", str(grpc_port))
                self.worker_urls.append(f"grpc://{LOOPBACK}:{grpc_port}")
            else:
                self.worker_urls.append(self.replica_urls[-1])
            replicas.append(self._spawn(
                [sys.executable, "-m", "scheduler.cli", "serve", "--model", str(self.model_dir),
                 "--host", LOOPBACK, "--port", str(port), *grpc_args, *self.serve_args],
                f"replica-{i}.log"))
        for proc, url in zip(replicas, self.replica_urls):
            self._wait(proc, "blockmgr serve",
                       lambda u=url: httpx.get(u + "/health", timeout=1).status_code == 200)
        binary = smg_binary()
        if binary is None:
            raise RuntimeError("the smg binary is not installed "
                               "(pip install 'mlx-blockmgr[fleet]')")
        port, metrics_port = free_port(), free_port()
        self.url = f"http://{LOOPBACK}:{port}"
        self.metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
        gateway = self._spawn(
            [binary, "launch", "--worker-urls", *self.worker_urls, "--policy", self.policy,
             "--host", LOOPBACK, "--port", str(port), "--prometheus-host", LOOPBACK,
             "--prometheus-port", str(metrics_port), *self.smg_args], "smg.log")
        self._wait(gateway, "smg", self._all_ready)

    def _all_ready(self) -> bool:
        workers = httpx.get(self.url + "/workers", timeout=1).json()["workers"]
        ready = [w for w in workers if w["is_healthy"] and w.get("status", "ready") == "ready"]
        return len(ready) == self.num_replicas

    def _wait(self, proc: subprocess.Popen, name: str, up) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} "
                                   f"(logs in {self.logs})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up in {self.timeout} s")
            try:
                if up():
                    return
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the gateway first
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for out in self.files:
            out.close()
        self.procs, self.files = [], []


class EventView:
    """A router's view rebuilt from SMG's `SubscribeKvEvents` batches, read as
    SMG reads them: block hash -> (parent hash, the block's tokens) and its
    namespace (`lora_name`); a store chained to a parent it holds (or none),
    removals of blocks it holds, every block `block_size` tokens. `numbered`:
    batches also come numbered without a gap (a snapshot restarts the count
    and begins with a clear)."""

    def __init__(self, block_size: int, numbered: bool = False) -> None:
        self.block_size = block_size
        self.numbered = numbered
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.namespaces: dict[int, str | None] = {}
        self.last: int | None = None
        self.num_batches = 0
        self.error: Exception | None = None

    def clear(self) -> None:
        """Forget every block, as a gateway does before it resubscribes from zero."""
        self.blocks.clear()
        self.namespaces.clear()
        self.last = None

    def apply(self, batch) -> None:
        if self.numbered:
            if batch.HasField("snapshot"):
                assert batch.events[0].WhichOneof("data") == "cleared"
            elif self.last is not None:
                assert batch.sequence_number == self.last + 1, (self.last, batch.sequence_number)
            self.last = batch.sequence_number
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "cleared":
                self.blocks.clear()
            elif kind == "removed":
                for digest in event.removed.block_hashes:
                    del self.blocks[digest]
            else:
                self._store(event.stored)
        self.num_batches += 1

    def _store(self, stored) -> None:
        parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
        assert parent is None or parent in self.blocks, "stored before its parent"
        namespace = stored.lora_name if stored.HasField("lora_name") else None
        for block in stored.blocks:
            assert block.block_size == self.block_size
            self.blocks[block.block_hash] = (parent, tuple(block.token_ids))
            self.namespaces[block.block_hash] = namespace
            parent = block.block_hash

    def prefixes(self, namespaced: bool = False) -> set:
        """Every held block's whole prefix (with its namespace: `namespaced`)."""
        result: set = set()
        for digest in self.blocks:
            runs: list[tuple[int, ...]] = []
            current: int | None = digest
            while current is not None:
                current, tokens = self.blocks[current]
                runs.append(tokens)
            tokens = tuple(t for run in reversed(runs) for t in run)
            result.add((self.namespaces[digest], tokens) if namespaced else tokens)
        return result
