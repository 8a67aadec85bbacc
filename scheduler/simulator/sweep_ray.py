"""Sweep points on a Ray cluster (the optional `ray` extra).

`run_on_ray(tasks, address, run_point, on_done)` connects to the cluster at
`address` ("local" starts a private one on this machine), runs every task as
one Ray task and returns the rows as they finish. A point is one whole
simulation (seconds to minutes), so Ray's per-task overhead (milliseconds)
does not matter; the config travels as a plain dict. Ray is imported only
here, and only when a sweep asks for it.
"""

from __future__ import annotations

from collections.abc import Callable


class RayUnavailable(ValueError):
    """Ray is not installed or the cluster cannot be reached."""


def run_on_ray(tasks: list, address: str, run_point: Callable[[tuple], dict],
               on_done: Callable[[dict], None] | None = None,
               num_cpus: int | None = None) -> list[dict]:
    """Rows of every task (in completion order). `num_cpus` caps a local cluster."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'mlx-blockmgr[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        try:
            if address == "local":
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
    try:
        remote = ray.remote(run_point)
        pending = [remote.remote(task) for task in tasks]
        rows = []
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            row = ray.get(done[0])
            rows.append(row)
            if on_done:
                on_done(row)
        return rows
    finally:
        if started_here:
            ray.shutdown()
