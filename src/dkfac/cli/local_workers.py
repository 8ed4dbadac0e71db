"""Run a function on N local worker processes and report how each of them ended.

The workers are forked from a server that imported torch once (see :func:`_worker_context`)
and rendezvous through a file; a worker that raises stops the others and every worker's
outcome is shown (tracebacks, and the stacks of the workers that were stopped), with the
first failure's exception itself when it can be pickled (so that the command can tell bad
input from a crash).
"""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dkfac.comm import destroy_process_groups


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker of a failed run ended.

    Attributes:
        rank: the worker.
        summary: ``"ExceptionType: message"``, how the process exited, or that it was stopped.
        details: the worker's traceback, or where it was when it was stopped ("" if unknown).
        cause: the worker's exception, when it could be sent to the parent.
        lost: the process ended without reporting (killed, or crashed in native code).
    """

    rank: int
    summary: str
    details: str = ""
    cause: BaseException | None = None
    lost: bool = False


class WorkerError(RuntimeError):
    """A worker failed.

    The first failure the parent learnt of is usually the root cause; the others (peers that
    lost it, workers stopped while waiting) are in :attr:`failures` and :meth:`report`.

    Attributes:
        rank: the worker that failed first.
        summary: ``"ExceptionType: message"`` (or how the process exited).
        details: the worker's traceback ("" when it died without one).
        cause: the worker's exception, when it could be sent to the parent.
        failures: every worker that did not finish, the first failure first.
    """

    def __init__(
        self,
        rank: int,
        summary: str,
        details: str,
        cause: BaseException | None = None,
        *,
        others: Sequence[WorkerFailure] = (),
    ) -> None:
        verb = "" if summary.startswith("was lost") else "failed: "
        super().__init__(f"worker {rank} {verb}{summary}")
        self.rank, self.summary, self.details, self.cause = rank, summary, details, cause
        self.failures = [WorkerFailure(rank, summary, details, cause), *others]

    def report(self) -> str:
        """Every failed or stopped worker, first failure first: summary, then traceback or stack."""
        blocks = []
        for failure in self.failures:
            block = f"--- rank {failure.rank}: {failure.summary}"
            blocks.append(f"{block}\n{failure.details.rstrip()}" if failure.details else block)
        return "\n".join(blocks)


#: Modules the fork server imports once for every worker it starts.
WORKER_PRELOAD = ("torch", "torch.distributed", "dkfac")

#: Signal that makes a worker write every thread's Python stack to its stack file.
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)

#: Seconds the parent keeps listening for the other workers after the first failure: peers
#: that lose a failed worker usually fail within milliseconds; the rest are stopped and
#: their stacks shown.
FAILURE_GRACE_S = 3.0


def _worker_context() -> Any:
    """Where workers come from: a fork server that has imported torch once, else spawn.

    A spawned worker imports torch itself (about 2.5 s on two cores); a worker forked from
    the server starts in about 0.1 s. The server forks before any torch computation runs
    (no intra-op threads exist yet), so the children are as clean as spawned ones. Each
    worker takes the parent's environment at its own start (:func:`_worker`), not the
    server's. Their standard output and error are the server's, i.e. the parent's when it
    first started workers (a later redirection of the parent's file descriptors, as pytest's
    ``capfd`` does, does not reach them).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def _worker(
    target: Callable[..., Any],
    environ: dict[str, str],
    rank: int,
    world_size: int,
    init_file: str,
    stack_file: str,
    threads: int,
    results: Any,
    args: tuple[Any, ...],
    collective_timeout: float,
    backend: str,
) -> None:
    """Entry of one worker process: join the group, run ``target``, report to ``results``.

    Every outcome reaches the parent through ``results``: ``(rank, True, value, "", b"")``
    with the value saved by :func:`torch.save`, or ``(rank, False, summary, traceback,
    pickled exception)``.
    """
    # The fork server's environment is the parent's when the server started; the worker
    # runs with the parent's environment of now (e.g. GLOO_SOCKET_IFNAME set since).
    os.environ.clear()
    os.environ.update(environ)
    # All local: the worker's place on this machine picks its GPU (dkfac.cli.device).
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    torch.set_num_threads(threads)
    with open(stack_file, "w") as stacks:
        # Where the worker is, for the parent's report when it crashes or is stopped.
        faulthandler.enable(stacks, all_threads=True)
        if STACK_SIGNAL is not None:
            faulthandler.register(STACK_SIGNAL, stacks, all_threads=True)
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
            destroy_process_groups()


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


class _WorkerPool:
    """The spawned processes of one run and what each has reported."""

    def __init__(self, processes: list[Any], results: Any, stack_files: list[str]) -> None:
        self.processes = processes
        self.results = results
        self.stack_files = stack_files
        self.values: dict[int, Any] = {}
        self.failures: list[WorkerFailure] = []

    def settled(self, rank: int) -> bool:
        """Whether ``rank`` returned a value or is known to have failed."""
        return rank in self.values or any(f.rank == rank for f in self.failures)

    def pending(self) -> list[int]:
        """Ranks that have neither returned nor failed."""
        return [r for r in range(len(self.processes)) if not self.settled(r)]

    def receive(self, wait_s: float) -> None:
        """Take one report from the queue (or notice dead workers after ``wait_s``)."""
        try:
            rank, ok, payload, details, cause = self.results.get(timeout=wait_s)
        except queue.Empty:
            for rank in self.pending():
                code = self.processes[rank].exitcode
                if code not in (None, 0):
                    how = f"was lost: its process (pid {self.processes[rank].pid}) "
                    how += (
                        f"was killed by {signal.Signals(-code).name}"
                        if code < 0
                        else f"exited with code {code} without reporting"
                    )
                    self.failures.append(WorkerFailure(rank, how, self._stack(rank), lost=True))
            return
        if ok:
            self.values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            self.failures.append(WorkerFailure(rank, payload, details, _unpickled(cause)))

    def stop_pending(self, why: str) -> list[WorkerFailure]:
        """Dump the stacks of the unfinished workers, kill them, and describe each as stopped."""
        pending = [r for r in self.pending() if self.processes[r].is_alive()]
        if STACK_SIGNAL is not None:
            for rank in pending:
                try:
                    os.kill(self.processes[rank].pid, STACK_SIGNAL)
                except ProcessLookupError:
                    continue
            if pending:
                time.sleep(0.5)  # faulthandler writes from a signal handler, at once
        stopped = [
            WorkerFailure(rank, f"still running {why}; stopped", self._stack(rank))
            for rank in pending
        ]
        for rank in pending:
            self.processes[rank].kill()
        return stopped

    def _stack(self, rank: int) -> str:
        """What worker ``rank`` wrote to its stack file ("" when there is none)."""
        try:
            with open(self.stack_files[rank]) as stacks:
                return stacks.read()
        except OSError:
            return ""

    def error(self) -> WorkerError:
        """The run's failure, then every other worker's.

        A lost worker comes first (its peers only saw it vanish), else the first failure
        reported.
        """
        ordered = sorted(self.failures, key=lambda failure: not failure.lost)
        first, *others = ordered
        others += self.stop_pending(f"when rank {first.rank} failed")
        return WorkerError(first.rank, first.summary, first.details, first.cause, others=others)


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

    When a worker fails, the others are given :data:`FAILURE_GRACE_S` seconds to report
    (peers that lost it usually fail at once); those still running are then stopped, and
    the error carries every worker's outcome: tracebacks, and the stacks of stopped workers.

    Args:
        target: a module-level function (spawned processes import it).
        world_size: number of processes.
        threads: intra-op threads per process.
        args: positional arguments of ``target``.
        timeout: seconds after which all workers are killed (``None``: no limit).
        collective_timeout: seconds a collective may wait before the process group fails.
        backend: process group backend of the workers.

    Raises:
        WorkerError: a worker failed (the first failure; ``failures`` has every worker's).
        TimeoutError: ``timeout`` passed before every worker finished (the message holds the
            stacks of the unfinished workers).
    """
    context = _worker_context()
    results = context.Queue()
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        stack_files = [os.path.join(folder, f"stack-{rank}.txt") for rank in range(world_size)]
        processes = [
            context.Process(
                target=_worker,
                daemon=True,
                args=(
                    target,
                    dict(os.environ),
                    rank,
                    world_size,
                    init_file,
                    stack_files[rank],
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
        pool = _WorkerPool(processes, results, stack_files)
        try:
            grace_end: float | None = None
            while pool.pending():
                now = time.monotonic()
                if grace_end is not None and now > grace_end:
                    break
                if grace_end is None and deadline is not None and now > deadline:
                    stopped = pool.stop_pending(f"after {timeout:.0f} s")
                    stacks = "\n".join(f"--- rank {f.rank}\n{f.details}" for f in stopped)
                    missing = [f.rank for f in stopped]
                    raise TimeoutError(
                        f"workers {missing} did not finish within {timeout:.0f} s\n{stacks}"
                    )
                pool.receive(wait_s=0.2 if grace_end is not None else 1.0)
                if pool.failures and grace_end is None:
                    grace_end = time.monotonic() + FAILURE_GRACE_S
            if pool.failures:
                raise pool.error()
        finally:
            stop = time.monotonic() + 5
            for process in processes:
                process.join(timeout=max(0.0, stop - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join()
    return [pool.values[rank] for rank in range(world_size)]


def spawn_local(
    target: Callable[..., Any],
    world_size: int,
    threads: int,
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
    collective_timeout: float = 600.0,
) -> Any:
    """Run ``target(*args)`` on ``world_size`` local processes; rank 0's return value.

    Raises:
        WorkerError: the first worker that failed (the others are stopped).
    """
    return spawn_workers(
        target,
        world_size,
        threads,
        args,
        backend=backend,
        collective_timeout=collective_timeout,
    )[0]
