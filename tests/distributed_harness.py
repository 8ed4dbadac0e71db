"""Run a function on P spawned gloo processes, with a hard timeout and workers' tracebacks.

Usage in a test::

    results = run_workers(my_function, world_size=3, args=(...), timeout=120)

``my_function(rank, world_size, *args)`` must be defined at module level (spawned processes
import it) and return something picklable (tensors are fine). Each worker runs with one
intra-op thread so that several processes share the cores without oversubscription.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerFailedError(AssertionError):
    """A worker raised; the message carries its traceback."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    results: Any,
    args: tuple[Any, ...],
    collective_timeout: float,
) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        # Plain bytes: a tensor put on a torch.multiprocessing queue is shared through a file
        # descriptor that dies with this process, which may exit before the parent reads it.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt from a kill
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results by rank.

    Raises:
        WorkerFailedError: a worker raised (its traceback is in the message).
        TimeoutError: not every worker finished within ``timeout`` seconds (all are killed).
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(
                target=_worker,
                daemon=True,
                args=(fn, rank, world_size, init_file, results, args, max(10.0, timeout / 2)),
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        collected: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                try:
                    rank, ok, payload = results.get(timeout=max(0.1, remaining))
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise TimeoutError(
                        f"distributed test timed out after {timeout:.0f} s; "
                        f"ranks {missing} did not finish"
                    ) from None
                if not ok:
                    raise WorkerFailedError(f"rank {rank} of {world_size} failed:\n{payload}")
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for process in processes:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join()
    return [collected[rank] for rank in range(world_size)]
