"""Run a function on P spawned gloo processes, with a hard timeout and workers' tracebacks.

Usage in a test::

    results = run_workers(my_function, world_size=3, args=(...), timeout=120)

``my_function(rank, world_size, *args)`` must be defined at module level (spawned processes
import it) and return something picklable (tensors are fine). Each worker runs with one
intra-op thread so that several processes share the cores without oversubscription. The
processes are started by the same launcher as ``dkfac train --nproc N``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dkfac.cli.local_workers import WorkerError, spawn_workers


class WorkerFailedError(AssertionError):
    """A worker raised; the message carries every worker's traceback or stack."""


def _with_rank(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(dist.get_rank(), dist.get_world_size(), *args)


def run_workers(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results by rank.

    Raises:
        WorkerFailedError: a worker raised (the message has every worker's outcome: the first
            failure, then the others' tracebacks and the stacks of the workers stopped).
        TimeoutError: not every worker finished within ``timeout`` seconds (all are killed).
    """
    try:
        return spawn_workers(
            _with_rank,
            world_size,
            1,
            (fn, *args),
            timeout=timeout,
            collective_timeout=max(10.0, timeout / 2),
        )
    except WorkerError as error:
        raise WorkerFailedError(
            f"rank {error.rank} of {world_size} failed first: {error.summary}\n{error.report()}"
        ) from None
