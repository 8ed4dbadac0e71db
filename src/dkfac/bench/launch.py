"""One launch of the ``dkfac bench`` workers for one world size.

On this machine's own network (loopback) the workers are started by torchrun::

    python -m torch.distributed.run --standalone --nproc_per_node=P -m dkfac.bench.worker ...

On an :class:`~dkfac.bench.emulated_cluster.EmulatedCluster` each worker is started alone in
its own network namespace, pinned to its core, with the rendezvous in its environment
(:meth:`EmulatedCluster.environment`). Either way every process gets ``OMP_NUM_THREADS=1``
and this copy of ``dkfac`` first on the path, runs in its own process group, and has its
output streamed to stderr while its tail is kept. The launch is stopped when it times out or
is interrupted, and, on a cluster, when one worker fails (the others get
:data:`FAILURE_GRACE_S` to fail or finish first). Rank 0 writes the JSON report it returns.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dkfac
from dkfac.bench.emulated_cluster import EmulatedCluster
from dkfac.bench.options import BenchOptions

WORKER_MODULE = "dkfac.bench.worker"
#: Seconds the other workers of a cluster launch get after one failed, before they are stopped.
FAILURE_GRACE_S = 30.0
POLL_S = 0.2


@dataclass
class Launch:
    """Outcome of one launch (torchrun, or one process per emulated node)."""

    nprocs: int
    command: list[str]
    returncode: int | None
    timed_out: bool
    wall_s: float
    output_tail: list[str]
    report: dict[str, Any] | None
    cluster: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """Whether the launch exited cleanly and produced a report."""
        return self.returncode == 0 and not self.timed_out and self.report is not None

    def to_json(self) -> dict[str, Any]:
        """The launch as a JSON-ready dict (the output tail only when it failed)."""
        return {
            "nprocs": self.nprocs,
            "command": self.command,
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "wall_s": self.wall_s,
            "ok": self.ok,
            "output_tail": None if self.ok else self.output_tail,
            "report": self.report,
            "cluster": self.cluster,
        }


def _worker_env() -> dict[str, str]:
    """One thread per worker, and the workers import this very copy of ``dkfac``."""
    package_root = str(Path(dkfac.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=package_root if not path else os.pathsep.join([package_root, path]),
    )


@dataclass
class _Outcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    tail: list[str]


def run_processes(
    commands: Sequence[tuple[Sequence[str], Mapping[str, str]]],
    timeout: float,
    *,
    prefix_ranks: bool,
) -> _Outcome:
    """Start every ``(argv, env)``, stream their output, wait; stop all on failure or timeout.

    The return code is the first non-zero one in rank order (0 when all succeeded).
    """
    tail: collections.deque[str] = collections.deque(maxlen=200)
    start = time.perf_counter()
    processes: list[subprocess.Popen[str]] = []
    readers = []
    try:
        for rank, (argv, env) in enumerate(commands):
            process = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                env=dict(env),
                start_new_session=True,
            )
            processes.append(process)
            label = f"[rank {rank}] " if prefix_ranks else ""

            def pump(process: subprocess.Popen[str] = process, label: str = label) -> None:
                assert process.stdout is not None
                for line in process.stdout:
                    tail.append(label + line.rstrip("\n"))
                    print(label + line, end="", file=sys.stderr, flush=True)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            readers.append(reader)
        timed_out, first_failed = _wait_all(processes, timeout)
    except BaseException:
        _stop_all(processes)
        raise
    for reader in readers:
        reader.join(timeout=10.0)
    codes = [process.returncode for process in processes]
    # The code of the worker that failed first in time (the others may only have been stopped
    # because of it).
    returncode = 0 if first_failed is None else codes[first_failed]
    return _Outcome(returncode, timed_out, time.perf_counter() - start, list(tail))


def _stop_all(processes: Sequence[subprocess.Popen[str]]) -> None:
    """SIGTERM every process group at once, wait, then SIGKILL what is left (15 s each)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.killpg(process.pid, sig)
        deadline = time.perf_counter() + 15.0
        while any(p.poll() is None for p in processes) and time.perf_counter() < deadline:
            time.sleep(POLL_S)
        if all(p.poll() is not None for p in processes):
            return


def _wait_all(
    processes: Sequence[subprocess.Popen[str]], timeout: float
) -> tuple[bool, int | None]:
    """Wait for every process; whether it timed out, and which one failed first (if any).

    After the first failure the others get :data:`FAILURE_GRACE_S`, then they are stopped.
    """
    deadline = time.perf_counter() + timeout
    failed_at: float | None = None
    first_failed: int | None = None
    while True:
        now = time.perf_counter()
        if first_failed is None:
            failing = [i for i, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failing:
                first_failed, failed_at = failing[0], now
        if all(process.poll() is not None for process in processes):
            return False, first_failed
        if now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE_S):
            timed_out = now > deadline
            if timed_out:
                print(f"timed out after {timeout} s, stopping", file=sys.stderr)
            _stop_all(processes)
            return timed_out, first_failed
        time.sleep(POLL_S)


def launch(
    nprocs: int, options: BenchOptions, folder: Path, cluster: EmulatedCluster | None = None
) -> Launch:
    """Run the workers for ``nprocs`` processes (on ``cluster`` when given); rank 0's report."""
    out = folder / f"strategies_p{nprocs}.json"
    worker = ["-m", WORKER_MODULE, *options.worker_argv(out)]
    env = _worker_env()
    if cluster is None:
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
        commands = [([sys.executable, *torchrun, *worker], env)]
    else:
        if cluster.workers != nprocs:
            raise ValueError(f"the cluster has {cluster.workers} workers, not {nprocs}")
        commands = [
            (cluster.command(rank, [sys.executable, *worker]), cluster.environment(rank, env))
            for rank in range(nprocs)
        ]
    where = "" if cluster is None else f" on {cluster.link.label()} links"
    print(f"launching P={nprocs}{where}: {' '.join(commands[0][0])}", file=sys.stderr, flush=True)
    outcome = run_processes(commands, options.timeout, prefix_ranks=cluster is not None)
    tail = outcome.tail
    report = None
    if out.exists() and not outcome.timed_out:
        try:
            report = json.loads(out.read_text())
        except json.JSONDecodeError as error:
            tail.append(f"could not read {out}: {error}")
    if outcome.returncode != 0 or report is None:
        print(f"P={nprocs}: launch failed (returncode {outcome.returncode})", file=sys.stderr)
    return Launch(
        nprocs,
        list(commands[0][0]),
        outcome.returncode,
        outcome.timed_out,
        outcome.wall_s,
        tail,
        report,
        None if cluster is None else cluster.describe(),
    )
