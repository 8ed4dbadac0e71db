"""Atomic checkpoints: everything needed to continue a run exactly where it stopped."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict[str, Any]:
    """The random number generator states of this process."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(payload: dict[str, Any], folder: Path) -> Path:
    """Write ``payload`` to ``folder/checkpoint.pt`` via a temporary file and a rename.

    A crash while writing leaves the previous checkpoint intact: ``os.replace`` is atomic on
    POSIX and Windows when both paths are on the same file system.
    """
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / CHECKPOINT_NAME
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".checkpoint-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(payload, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The checkpoint in ``folder``, or ``None`` when there is none."""
    target = folder / CHECKPOINT_NAME
    if not target.is_file():
        return None
    payload: dict[str, Any] = torch.load(target, map_location="cpu", weights_only=False)
    return payload
