"""Start the workers of a run: as one rank of an outside launcher, or N local processes.

* Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) or Slurm ``srun``
  (``SLURM_PROCID``/``SLURM_NTASKS``), this process is one rank: it joins the job's process group.
* Otherwise ``--nproc N`` local processes are spawned, rendezvous through a file; a worker that
  raises stops the others and its error is shown, with the exception itself when it can be
  pickled (so that the command can tell bad input from a crash).

The process group backend follows the device the run trains on (:func:`backend_for`).
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker failed.

    Attributes:
        rank: the worker that failed first.
        summary: ``"ExceptionType: message"`` (or how the process exited).
        details: the worker's traceback ("" when it died without one).
        cause: the worker's exception, when it could be sent to the parent.
    """

    def __init__(
        self, rank: int, summary: str, details: str, cause: BaseException | None = None
    ) -> None:
        super().__init__(f"worker {rank} failed: {summary}")
        self.rank, self.summary, self.details, self.cause = rank, summary, details, cause


@dataclass(frozen=True)
class ExternalRank:
    """This process's place in a job started by torchrun or Slurm."""

    rank: int
    world_size: int
    launcher: str


def external_rank(environ: dict[str, str] | None = None) -> ExternalRank | None:
    """The rank given by torchrun or Slurm, if this process was started by one."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return ExternalRank(int(env["RANK"]), int(env["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        return ExternalRank(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), "slurm")
    return None


def backend_for(device: torch.device) -> str:
    """The process group backend for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_external(rank: ExternalRank, threads: int, backend: str) -> None:
    """Initialise the job's process group.

    Args:
        rank: this process's place in the job (:func:`external_rank`).
        threads: intra-op threads of this process.
        backend: ``"gloo"`` or ``"nccl"``, from :func:`backend_for` of the run's device.
    """
    torch.set_num_threads(threads)
    if rank.launcher == "slurm":  # srun sets no rendezvous variables of torch's own
        os.environ.setdefault(
            "MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
        )
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank.rank), str(rank.world_size)
    dist.init_process_group(backend, rank=rank.rank, world_size=rank.world_size)


def _worker(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    threads: int,
    results: Any,
    args: tuple[Any, ...],
    collective_timeout: float,
    backend: str,
) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        value = target(*args)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue(), "", b""))
    except BaseException as error:  # every failure reaches the parent
        summary = f"{type(error).__name__}: {error}"
        results.put((rank, False, summary, traceback.format_exc(), _pickled(error)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pickled(error: BaseException) -> bytes:
    """``error`` pickled (its type, arguments and attributes), or b"" when it cannot be."""
    try:
        return pickle.dumps(error)
    except Exception:  # an exception holding something unpicklable: the summary must do
        return b""


def _unpickled(payload: bytes) -> BaseException | None:
    """The exception a worker sent, or None."""
    if not payload:
        return None
    try:
        error = pickle.loads(payload)
    except Exception:  # e.g. a class whose __init__ needs other arguments
        return None
    return error if isinstance(error, BaseException) else None


def spawn_workers(
    target: Callable[..., Any],
    world_size: int,
    threads: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float | None = None,
    collective_timeout: float = 600.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` local processes; every rank's result.

    Args:
        target: a module-level function (spawned processes import it).
        world_size: number of processes.
        threads: intra-op threads per process.
        args: positional arguments of ``target``.
        timeout: seconds after which all workers are killed (``None``: no limit).
        collective_timeout: seconds a collective may wait before the process group fails.
        backend: process group backend of the workers.

    Raises:
        WorkerError: the first worker that failed (the others are stopped).
        TimeoutError: ``timeout`` passed before every worker finished.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(
                target=_worker,
                daemon=True,
                args=(
                    target,
                    rank,
                    world_size,
                    init_file,
                    threads,
                    results,
                    args,
                    collective_timeout,
                    backend,
                ),
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        values: dict[int, Any] = {}
        try:
            while len(values) < world_size:
                if deadline is not None and time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise TimeoutError(f"workers {missing} did not finish within {timeout:.0f} s")
                try:
                    rank, ok, payload, details, cause = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(processes)
                        if p.exitcode not in (None, 0) and r not in values
                    ]
                    if dead:
                        raise WorkerError(
                            dead[0], f"exited with code {processes[dead[0]].exitcode}", ""
                        ) from None
                    continue
                if not ok:
                    raise WorkerError(rank, payload, details, _unpickled(cause))
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            stop = time.monotonic() + 5
            for process in processes:
                process.join(timeout=max(0.0, stop - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join()
    return [values[rank] for rank in range(world_size)]


def spawn_local(
    target: Callable[..., Any],
    world_size: int,
    threads: int,
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
) -> Any:
    """Run ``target(*args)`` on ``world_size`` local processes; rank 0's return value.

    Raises:
        WorkerError: the first worker that failed (the others are stopped).
    """
    return spawn_workers(target, world_size, threads, args, backend=backend)[0]
