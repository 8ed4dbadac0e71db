"""Checkpoints that survive crashes: atomic, verified, the last two kept.

Each checkpoint is ``checkpoint.pt`` with its SHA-256 in ``checkpoint.pt.sha256``; writing a
new one first moves the current pair to ``checkpoint.prev.pt``(``.sha256``). Loading checks
the digest and reads with ``torch.load(weights_only=True)``; a truncated or corrupted newest
checkpoint is reported in one line and the previous one is used. A crash at any point of a
save leaves a usable checkpoint: the new pair is fully written and synced before any rename,
and a half-renamed pair fails its digest check, so the previous pair is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from dkfac.cli.config import ConfigError

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"
DIGEST_SUFFIX = ".sha256"


class CheckpointError(ConfigError):
    """No usable checkpoint where one was asked for (the message says what is wrong)."""


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


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def _write_synced(folder: Path, data: bytes, prefix: str) -> Path:
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return Path(temporary)


def save_atomic(payload: dict[str, Any], folder: Path) -> Path:
    """Write ``payload`` as ``folder/checkpoint.pt``, keeping the previous one as ``.prev``.

    Returns:
        The path of the new checkpoint.
    """
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    target, previous = folder / CHECKPOINT_NAME, folder / PREVIOUS_NAME
    written = _write_synced(folder, data, ".checkpoint-")
    try:
        digest = _write_synced(folder, hashlib.sha256(data).hexdigest().encode(), ".digest-")
    except BaseException:
        written.unlink(missing_ok=True)
        raise
    if target.is_file():
        os.replace(target, previous)
        if _digest_path(target).is_file():
            os.replace(_digest_path(target), _digest_path(previous))
        else:  # a checkpoint of an older dkfac: the previous one has no digest either
            _digest_path(previous).unlink(missing_ok=True)
    os.replace(written, target)
    os.replace(digest, _digest_path(target))
    return target


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint (usable or not)."""
    return (folder / CHECKPOINT_NAME).is_file() or (folder / PREVIOUS_NAME).is_file()


def _read_verified(path: Path) -> dict[str, Any]:
    """The payload of the checkpoint at ``path``, checked against its digest.

    Raises:
        ValueError: the file is truncated or corrupted (the message says how).
    """
    data = path.read_bytes()
    digest_file = _digest_path(path)
    if digest_file.is_file():
        expected = digest_file.read_text().strip()
        if hashlib.sha256(data).hexdigest() != expected:
            raise ValueError(
                f"its SHA-256 does not match {digest_file.name} (truncated or corrupted, "
                f"{len(data)} bytes)"
            )
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated zip, a pickle of something else, ...
        raise ValueError(f"it cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"it holds a {type(payload).__name__}, not a dkfac checkpoint")
    return payload


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The newest usable checkpoint in ``folder``, or ``None`` when there is none.

    A newest checkpoint that is truncated or corrupted is reported (one warning line) and the
    previous one is used.

    Raises:
        CheckpointError: checkpoints exist but none is usable.
    """
    problems = []
    for name in (CHECKPOINT_NAME, PREVIOUS_NAME):
        path = folder / name
        if not path.is_file():
            continue
        try:
            payload = _read_verified(path)
        except ValueError as error:
            problems.append(f"{path}: {error}")
            continue
        if problems:
            logger.warning("checkpoint %s; using %s instead", problems[0], path)
        return payload
    if problems:
        raise CheckpointError("no usable checkpoint: " + "; ".join(problems))
    return None
