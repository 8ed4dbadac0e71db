"""Lost workers: every other worker stops with the lost rank named, and runs survive restarts.

Each test starts ``dkfac train`` (or torchrun) in a process of its own, waits until training
is under way (``metrics.jsonl`` has a few steps), kills one worker with SIGKILL, as a
preempted node or the OOM killer would, and checks what happens next.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dkfac.cli.main import main

#: A run long enough to be killed in the middle: 2 epochs of 20 steps of the CNN with K-FAC.
RUN = [
    "train",
    "--model",
    "cnn",
    "--epochs",
    "2",
    "--steps-per-epoch",
    "20",
    "--log-every",
    "1",
    "--checkpoint-every",
    "3",
    "--strategy",
    "dkfac",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def parent_of(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def children_of(pid: int) -> list[int]:
    pids = [int(path.split("/")[2]) for path in glob.glob("/proc/[0-9]*/stat")]
    return sorted(p for p in pids if parent_of(p) == pid)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def local_workers(pid: int) -> list[int]:
    """Workers of a ``dkfac train`` process: the children of its fork server."""
    servers = [child for child in children_of(pid) if "forkserver" in command_line(child)]
    return [worker for server in servers for worker in children_of(server)]


def steps_done(out: Path) -> list[dict]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if "event" not in r]


def kill_a_worker_at(
    process: subprocess.Popen[str], out: Path, step: int, workers: callable
) -> tuple[int, float]:
    """Wait until ``step`` steps are logged, SIGKILL the newest worker; (pid, time)."""
    deadline = time.monotonic() + 120
    while len(steps_done(out)) < step:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.02)
    victim = max(workers(process.pid))
    os.kill(victim, signal.SIGKILL)
    return victim, time.monotonic()


def start(command: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The steps of the same run on two workers, never interrupted (in this process)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert main([*RUN, "--nproc", "2", "--out", str(out)]) == 0
    return steps_done(out)


def same_steps(got: list[dict], want: list[dict]) -> None:
    keys = ("step", "loss", "lr", "accuracy")
    assert [[s[k] for k in keys] for s in got] == [[s[k] for k in keys] for s in want]


def test_a_killed_local_worker_stops_the_run_naming_the_lost_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    process = start(
        [sys.executable, "-m", "dkfac", *RUN, "--nproc", "3", "--out", str(out)],
        tmp_path,
    )
    victim, killed = kill_a_worker_at(process, out, 3, local_workers)
    _, err = process.communicate(timeout=90)
    assert process.returncode == 1
    assert time.monotonic() - killed < 60
    lost = [line for line in err.splitlines() if "was lost" in line]
    assert lost and lost[0].startswith("dkfac: worker "), err[-3000:]
    assert f"was lost: its process (pid {victim}) was killed by SIGKILL" in lost[0]


def test_a_killed_local_worker_is_replaced_and_the_run_ends_as_if_uninterrupted(
    tmp_path: Path, uninterrupted: list[dict]
) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dkfac", *RUN, "--nproc", "2"]
    process = start([*command, "--max-restarts", "1", "--out", str(out)], tmp_path)
    _, _ = kill_a_worker_at(process, out, 5, local_workers)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-3000:]
    assert "restarting the workers (restart 1 of 1) from the last checkpoint" in err
    resumed = [
        int(line.split("resumed from step ")[1].split()[0])
        for line in err.splitlines()
        if "resumed from step" in line
    ]
    last_logged = max(s["step"] for s in uninterrupted[:5])  # at least this was done
    assert len(resumed) == 1 and resumed[0] >= last_logged - 3  # at most one interval again
    same_steps(steps_done(out), uninterrupted)


def test_torchrun_restarts_a_killed_worker_and_the_run_ends_as_if_uninterrupted(
    tmp_path: Path, uninterrupted: list[dict]
) -> None:
    out = tmp_path / "run"
    command = [*TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1"]
    process = start([*command, "-m", "dkfac", *RUN, "--out", str(out)], tmp_path)
    kill_a_worker_at(process, out, 5, children_of)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-3000:]
    assert "restarted by torchrun (restart 1): resuming from the last checkpoint" in err
    same_steps(steps_done(out), uninterrupted)


def test_under_torchrun_the_others_stop_at_once_and_the_lost_rank_is_named(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    command = [*TORCHRUN, "--nproc-per-node", "3", "--max-restarts", "0"]
    process = start([*command, "-m", "dkfac", *RUN, "--out", str(out)], tmp_path)
    victim, killed = kill_a_worker_at(process, out, 3, children_of)
    _, err = process.communicate(timeout=90)
    assert process.returncode != 0
    assert time.monotonic() - killed < 60
    # Each survivor says in one line why it stopped, with no traceback of its own: its
    # collective failed (a peer was lost), or torchrun's SIGTERM came first, as it does when
    # torchrun notices the death before the survivor's collective does. torchrun's report
    # names the lost rank.
    signs = ("a peer worker was lost", "stopped by the launcher (SIGTERM)")
    survivors = [line for line in err.splitlines() if any(sign in line for sign in signs)]
    assert len(survivors) == 2, err[-3000:]
    # (torchrun may prefix a worker's lines with "[rankN]:")
    assert all("dkfac: [rank " in line or "dkfac: error:" in line for line in survivors), survivors
    assert err.count("Traceback (most recent call last)") == 1, err[-3000:]  # torchrun's own
    assert f"exitcode  : -9 (pid: {victim})" in err


def test_a_stuck_worker_fails_the_run_within_the_collective_timeout(tmp_path: Path) -> None:
    # SIGSTOP: the process is alive and its sockets open, so nobody sees it vanish; the
    # collective timeout (8 s here) is what ends the run.
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dkfac", *RUN, "--nproc", "2"]
    process = start([*command, "--collective-timeout", "8", "--out", str(out)], tmp_path)
    deadline = time.monotonic() + 120
    while len(steps_done(out)) < 3:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    victim = max(local_workers(process.pid))
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = process.communicate(timeout=90)
    assert process.returncode == 1
    assert time.monotonic() - stopped < 8 + 20
    assert "Timed out" in err or "timed out" in err, err[-3000:]
    assert "still running when rank" in err and "; stopped" in err


def test_a_worker_stopped_by_its_launcher_says_so_in_one_line(tmp_path: Path) -> None:
    # As torchrun (a peer failed) or Slurm (scancel, preemption) would: SIGTERM to a worker.
    out = tmp_path / "run"
    environ = os.environ | {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29400 + os.getpid() % 500),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "dkfac", *RUN, "--out", str(out)],
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(steps_done(out)) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = [line for line in err.splitlines() if "stopped by the launcher (SIGTERM)" in line]
    assert len(lines) == 1 and lines[0].startswith("dkfac: error: "), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_sigterm_raises_only_inside_the_block_and_the_old_handler_comes_back() -> None:
    from dkfac.cli.launcher_signals import LauncherStopError, sigterm_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(LauncherStopError, match="SIGTERM"), sigterm_raises():
        try:  # code on the way that falls back on any error must not swallow the stop
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this at once
        except Exception:
            pytest.fail("an `except Exception` caught the launcher's stop")
    assert signal.getsignal(signal.SIGTERM) is before
    with sigterm_raises(enabled=False):
        assert signal.getsignal(signal.SIGTERM) is before
