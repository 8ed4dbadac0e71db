"""The run's metrics as TensorBoard scalars (``dkfac train --tensorboard DIR``).

Every record that goes to ``metrics.jsonl`` is also written here, as scalars at the record's
step: a step record's loss, accuracy, learning rate and seconds under ``train/``, its K-FAC
phase seconds under ``kfac_seconds/`` and its communicated bytes as ``kfac/comm_bytes``; an
epoch record's numbers under ``epoch/``. A resumed run purges what a crashed run wrote after
its checkpoint, as ``metrics.jsonl`` is truncated there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

#: How ``pip`` gets TensorBoard for dkfac (the writer is torch's; the event format is
#: TensorBoard's own package).
INSTALL_HINT = "pip install 'dkfac[tensorboard]'"


def tensorboard_missing() -> str | None:
    """Why ``--tensorboard`` cannot work here (the package is missing), or None."""
    if importlib.util.find_spec("tensorboard") is None:
        return f"--tensorboard needs the tensorboard package ({INSTALL_HINT})"
    return None


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one ``metrics.jsonl`` record, by tag."""
    if record.get("event") == "epoch":
        return {
            f"epoch/{key}": float(value)
            for key, value in record.items()
            if key not in ("event", "step") and _is_number(value)
        }
    if "event" in record:  # the strategy chosen by --strategy auto: text, no scalar
        return {}
    tags = {
        f"train/{key}": float(record[key])
        for key in ("loss", "accuracy", "lr", "seconds")
        if _is_number(record.get(key))
    }
    tags.update(
        {f"kfac_seconds/{phase}": float(s) for phase, s in record.get("kfac_seconds", {}).items()}
    )
    if _is_number(record.get("comm_bytes")):
        tags["kfac/comm_bytes"] = float(record["comm_bytes"])
    return tags


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class TensorBoardLog:
    """Writes records as scalars into ``directory`` (the writer opens at the first record).

    Args:
        directory: the TensorBoard log directory.

    Raises:
        RuntimeError: the tensorboard package is not installed (with the install command).
    """

    def __init__(self, directory: str) -> None:
        missing = tensorboard_missing()
        if missing is not None:
            raise RuntimeError(missing)
        self.directory = directory
        self._purge_step: int | None = None
        self._writer: Any = None

    def resumed_at(self, step: int) -> None:
        """The run continues from ``step``: events written after it are dropped."""
        self._purge_step = step + 1

    def write(self, record: Mapping[str, Any]) -> None:
        """Add the scalars of ``record`` at its ``step``."""
        tags = scalars(record)
        if not tags:  # nothing to write: the writer opens later (after a resume's purge step)
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.directory, purge_step=self._purge_step)
        step = int(record.get("step", 0))
        for tag, value in tags.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
