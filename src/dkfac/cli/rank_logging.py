"""Logging of the ``dkfac`` command: rank 0 speaks, the other ranks only warn.

Every process of a run (the parent, spawned workers, ranks started by torchrun or Slurm) calls
:func:`configure_logging` with its rank. Rank 0 logs INFO and above as plain messages; every
other rank logs WARNING and above, each line prefixed with its rank, so that N processes
writing to one terminal never repeat each other's progress lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


class _RankHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (tests replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def rank_format(rank: int) -> str:
    """The log line format of ``rank``: the bare message on rank 0, a rank prefix elsewhere."""
    if rank == 0:
        return "%(message)s"
    return f"[rank {rank}] %(levelname)s %(name)s: %(message)s"


def configure_logging(rank: int) -> None:
    """Configure the root logger of this process for ``rank`` (replacing an earlier call's).

    Args:
        rank: this process's rank in the run (0 for the parent of spawned workers).
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _RankHandler)]:
        root.removeHandler(handler)
    handler = _RankHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(rank_format(rank)))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


@contextlib.contextmanager
def quiet(name: str = "dkfac") -> Iterator[None]:
    """Log only warnings and errors of logger ``name`` (and its children) inside the block."""
    target = logging.getLogger(name)
    previous = target.level
    target.setLevel(logging.WARNING)
    try:
        yield
    finally:
        target.setLevel(previous)
