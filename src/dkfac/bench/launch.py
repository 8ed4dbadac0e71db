"""One torchrun launch of the ``dkfac bench`` workers for one world size.

Starts ``python -m torch.distributed.run --standalone --nproc_per_node=P -m dkfac.bench.worker``
in its own process group (``OMP_NUM_THREADS=1``, this copy of ``dkfac`` first on the path),
streams the workers' output to stderr while keeping its tail, stops the whole group when the
launch times out or is interrupted, and reads the JSON report that rank 0 wrote.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dkfac
from dkfac.bench.options import BenchOptions

WORKER_MODULE = "dkfac.bench.worker"


@dataclass
class Launch:
    """Outcome of one torchrun launch."""

    nprocs: int
    command: list[str]
    returncode: int | None
    timed_out: bool
    wall_s: float
    output_tail: list[str]
    report: dict[str, Any] | None

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
        }


def _stop(process: subprocess.Popen[str]) -> None:
    """Terminate the launch's process group (torchrun and its workers), then kill it."""
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


def launch(nprocs: int, options: BenchOptions, folder: Path) -> Launch:
    """Run the workers for ``nprocs`` processes through torchrun; collect rank 0's report."""
    out = folder / f"strategies_p{nprocs}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nprocs}",
        "-m",
        WORKER_MODULE,
        *options.worker_argv(out),
    ]
    print(f"launching P={nprocs}: {' '.join(command)}", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=200)
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_worker_env(),
        start_new_session=True,
    )

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            print(line, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        returncode: int | None = process.wait(timeout=options.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"P={nprocs}: timed out after {options.timeout} s, stopping", file=sys.stderr)
        _stop(process)
        returncode = process.poll()
    except BaseException:
        _stop(process)
        raise
    reader.join(timeout=10.0)
    wall_s = time.perf_counter() - start
    report = None
    if out.exists() and not timed_out:
        try:
            report = json.loads(out.read_text())
        except json.JSONDecodeError as error:
            tail.append(f"could not read {out}: {error}")
    if returncode != 0 or report is None:
        print(f"P={nprocs}: launch failed (returncode {returncode})", file=sys.stderr)
    return Launch(nprocs, command, returncode, timed_out, wall_s, list(tail), report)
