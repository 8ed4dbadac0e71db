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


def _stop(process: subprocess.Popen[str]) -> None:
    """Terminate the process's group (torchrun and its workers, or one worker), then kill it."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


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
        timed_out = _wait_all(processes, timeout)
    except BaseException:
        for process in processes:
            _stop(process)
        raise
    for reader in readers:
        reader.join(timeout=10.0)
    codes = [process.returncode for process in processes]
    failed = [code for code in codes if code != 0]
    returncode = failed[0] if failed else 0
    return _Outcome(returncode, timed_out, time.perf_counter() - start, list(tail))


def _wait_all(processes: Sequence[subprocess.Popen[str]], timeout: float) -> bool:
    """Wait for every process; whether the launch timed out. Stops the rest after a failure."""
    deadline = time.perf_counter() + timeout
    failed_at: float | None = None
    while any(process.poll() is None for process in processes):
        now = time.perf_counter()
        if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE_S):
            timed_out = now > deadline
            if timed_out:
                print(f"timed out after {timeout} s, stopping", file=sys.stderr)
            for process in processes:
                _stop(process)
            return timed_out
        time.sleep(POLL_S)
    return False


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
