"""What a run records: its result, its K-FAC phase totals, and its ``metrics.jsonl`` lines."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dkfac
from dkfac.cli.tensorboard_log import TensorBoardLog

METRICS_NAME = "metrics.jsonl"


@dataclass
class PhaseTotals:
    """This rank's K-FAC phase seconds and communicated bytes, summed over an epoch."""

    seconds: dict[str, float] = field(default_factory=dict)
    comm_bytes: int = 0

    def add_step(self, pre: dkfac.KFACPreconditioner) -> None:
        """Add the last step of ``pre`` (its timings and communication)."""
        for phase, seconds in pre.timings().items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.comm_bytes += sum(stats["bytes"] for stats in pre.comm_stats().values())

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` fields (and the checkpointed state)."""
        return {"kfac_seconds": dict(self.seconds), "comm_bytes": self.comm_bytes}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> PhaseTotals:
        """Inverse of :meth:`record` (empty totals for ``None``)."""
        if not record:
            return cls()
        return cls(dict(record["kfac_seconds"]), int(record["comm_bytes"]))


@dataclass
class RunResult:
    """What a finished run reports (rank 0's view; evaluation aggregated over ranks)."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0
    stopped: bool = False

    @property
    def final_accuracy(self) -> float:
        """Test accuracy after the last epoch."""
        return float(self.epochs[-1]["test_accuracy"]) if self.epochs else math.nan


def append_metrics(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to the metrics file ``path`` as one JSON line."""
    with path.open("a") as stream:
        stream.write(json.dumps(record) + "\n")


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics written after the checkpoint at ``step`` (a crashed run's tail).

    That includes what an earlier resumption from this same checkpoint recorded at ``step``
    itself (records marked ``"resumed": true``): resuming from one checkpoint twice records
    its resumption once.
    """
    if not path.is_file():
        return

    def before_checkpoint(record: dict[str, Any]) -> bool:
        at = record.get("step", 0)
        return bool(at < step or (at == step and not record.get("resumed", False)))

    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and before_checkpoint(json.loads(line))
    ]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLog:
    """Where rank 0's records go: ``metrics.jsonl`` in the run folder and TensorBoard.

    Args:
        out: the run folder (None: no ``metrics.jsonl``).
        tensorboard: the ``--tensorboard`` log (None: none).
    """

    def __init__(self, out: Path | None, tensorboard: TensorBoardLog | None) -> None:
        self.out = out
        self.tensorboard = tensorboard
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)

    @property
    def active(self) -> bool:
        """Whether records go anywhere (only on rank 0)."""
        return self.out is not None or self.tensorboard is not None

    def write(self, record: dict[str, Any]) -> None:
        """Record one step, epoch or event."""
        if self.out is not None:
            append_metrics(self.out / METRICS_NAME, record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def resumed_at(self, step: int) -> None:
        """Forget what a crashed run recorded after its checkpoint at ``step``."""
        if self.out is not None:
            truncate_metrics(self.out / METRICS_NAME, step)
        if self.tensorboard is not None:
            self.tensorboard.resumed_at(step)

    def close(self) -> None:
        """Close the TensorBoard event file."""
        if self.tensorboard is not None:
            self.tensorboard.close()
