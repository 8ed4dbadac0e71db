"""SIGTERM from torchrun or Slurm, turned into one line instead of a silent death.

torchrun sends SIGTERM to every surviving worker as soon as one fails, and Slurm does so when a
job is cancelled or preempted. With Python's default action the worker vanishes without a word,
so its log cannot tell a rank that was stopped from one that crashed. Under such a launcher the
CLI raises :class:`LauncherStopError` instead and reports it in one line.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


class LauncherStopError(BaseException):
    """The launcher asked this worker to stop (SIGTERM): a peer failed, or the job was ended.

    A ``BaseException``, like ``KeyboardInterrupt``: an ``except Exception`` on the way (a
    checkpoint reader falling back to the previous checkpoint) must not swallow it.
    """


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise LauncherStopError(signal.Signals(signum).name)


@contextlib.contextmanager
def sigterm_raises(enabled: bool = True) -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`LauncherStopError` in the main thread.

    The exception is raised when the interpreter next runs Python code: a worker inside a
    collective or a kernel stops once that returns (a collective whose peer is gone fails at
    once; the launcher's SIGKILL after its grace period covers the rest). The previous handler
    is restored on exit. ``enabled=False`` (no launcher) leaves SIGTERM alone.
    """
    if not enabled:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ignore_sigterm() -> None:
    """Let a final report finish: a SIGTERM arriving while it is written would cut it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
