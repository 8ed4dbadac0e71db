"""CIFAR-10 from the standard *python* batches on local disk (never downloaded).

The batches are pickles; they are read with an unpickler that resolves only numpy's array
reconstruction, so a tampered file cannot run code.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import TensorDataset

from dkfac.data.builtin import import_numpy

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the CIFAR-10 training images (pixels scaled to ``[0, 1]``)."""

CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the CIFAR-10 training images."""

_CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR10_TRAIN_FILES = tuple(f"data_batch_{index}" for index in range(1, 6))
_CIFAR10_TEST_FILE = "test_batch"
_CIFAR10_PIXELS = 3 * 32 * 32
CIFAR10_CLASSES = 10
_DATA_ENV = "DKFAC_DATA"

# Globals a CIFAR-10 batch pickle may reference: numpy's array reconstruction helpers
# (numpy 1.x lives under ``numpy.core``, numpy 2.x under ``numpy._core``).
_NUMPY_PICKLE_MODULES = frozenset(
    {
        "numpy",
        "numpy.core.multiarray",
        "numpy._core.multiarray",
        "numpy.core.numeric",
        "numpy._core.numeric",
    }
)
_NUMPY_PICKLE_NAMES = frozenset({"ndarray", "dtype", "_reconstruct", "_frombuffer", "scalar"})


def default_cifar10_root() -> Path:
    """The CIFAR-10 folder used when no ``root`` is given.

    Returns:
        ``$DKFAC_DATA`` when that environment variable is set (either the batches folder
        itself or a folder containing ``cifar-10-batches-py``), else
        ``~/.cache/dkfac/cifar-10-batches-py``.

    """
    configured = os.environ.get(_DATA_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "dkfac" / _CIFAR10_DIR


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that resolves only numpy's array-reconstruction globals.

    CIFAR-10 batches are pickles; refusing every other global means a tampered file
    cannot run code while it is read.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module in _NUMPY_PICKLE_MODULES and name in _NUMPY_PICKLE_NAMES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR-10 batch")


def _resolve_cifar10_root(root: Path | None) -> Path:
    """The folder that should hold the batch files (see :func:`load_dataset`)."""
    folder = default_cifar10_root() if root is None else root
    nested = folder / _CIFAR10_DIR
    if not (folder / _CIFAR10_TRAIN_FILES[0]).exists() and nested.is_dir():
        return nested
    return folder


def _missing_cifar10(path: Path, folder: Path, what: str) -> FileNotFoundError:
    """The error for a missing CIFAR-10 folder or batch file."""
    return FileNotFoundError(
        f"CIFAR-10 {what} not found: expected {path}. dkfac never downloads data: download "
        "cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and extract "
        f"it so that {folder / _CIFAR10_TRAIN_FILES[0]} exists, or pass --data-root (root=) "
        f"pointing at the extracted {_CIFAR10_DIR} folder (default: ${_DATA_ENV} or "
        f"~/.cache/dkfac/{_CIFAR10_DIR})"
    )


def _read_cifar10_batch(path: Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Read one CIFAR-10 python batch as ``(N, 3072)`` uint8 pixels and ``(N,)`` labels.

    Raises:
        ValueError: If the file is not a valid CIFAR-10 batch.

    """
    numpy = import_numpy("the cifar10 dataset")
    try:
        with path.open("rb") as handle:
            content = _NumpyOnlyUnpickler(handle, encoding="bytes").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        LookupError,
        AttributeError,
        ImportError,
        OverflowError,
    ) as exc:
        raise ValueError(f"{path} is not a valid CIFAR-10 python batch: {exc}") from exc
    if not isinstance(content, dict):
        raise ValueError(
            f"{path} is not a valid CIFAR-10 python batch: expected a dict, "
            f"got {type(content).__name__}"
        )

    def _entry(key: str) -> Any:
        for candidate in (key.encode(), key):
            if candidate in content:
                return content[candidate]
        raise ValueError(
            f"{path} is not a valid CIFAR-10 python batch: missing key b{key!r} "
            f"(found {sorted(map(repr, content))})"
        )

    try:
        data = numpy.asarray(_entry("data"))
        labels = numpy.asarray(_entry("labels"))
    except (TypeError, ValueError) as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path} is not a valid CIFAR-10 python batch: {exc}") from exc
    if data.ndim != 2 or data.shape[1] != _CIFAR10_PIXELS or data.dtype != numpy.uint8:
        raise ValueError(
            f"{path} is not a valid CIFAR-10 python batch: b'data' must be an N x "
            f"{_CIFAR10_PIXELS} uint8 array, got shape {data.shape} dtype {data.dtype}"
        )
    if (
        labels.ndim != 1
        or labels.shape[0] != data.shape[0]
        or not numpy.issubdtype(labels.dtype, numpy.integer)
    ):
        raise ValueError(
            f"{path} is not a valid CIFAR-10 python batch: b'labels' must be {data.shape[0]} "
            f"integers, got shape {labels.shape} dtype {labels.dtype}"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= CIFAR10_CLASSES):
        raise ValueError(
            f"{path} is not a valid CIFAR-10 python batch: labels must be in "
            f"[0, {CIFAR10_CLASSES}), got [{labels.min()}, {labels.max()}]"
        )
    return data, labels.astype(numpy.int64)


def _cifar10_split(paths: Sequence[Path]) -> TensorDataset:
    """Concatenate batch files into one normalized ``(N, 3, 32, 32)`` dataset."""
    numpy = import_numpy("the cifar10 dataset")
    batches = [_read_cifar10_batch(path) for path in paths]
    pixels = numpy.concatenate([data for data, _ in batches])
    labels = numpy.concatenate([label for _, label in batches])
    images = torch.from_numpy(pixels).reshape(-1, 3, 32, 32).to(torch.float32)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    images.div_(255.0).sub_(mean).div_(std)
    return TensorDataset(images, torch.from_numpy(labels))


def load_cifar10(root: Path | None = None) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets from the python batches in ``root`` (see :func:`default_cifar10_root`).

    Images are ``(3, 32, 32)`` floats normalised per channel with :data:`CIFAR10_MEAN` and
    :data:`CIFAR10_STD`; labels are int64.

    Raises:
        FileNotFoundError: the folder or a batch file is missing (the message says where).
        ValueError: a batch file is malformed (the message names it).
    """
    folder = _resolve_cifar10_root(root)
    if not folder.is_dir():
        raise _missing_cifar10(folder, folder, "folder")
    files = [folder / name for name in (*_CIFAR10_TRAIN_FILES, _CIFAR10_TEST_FILE)]
    for path in files:
        if not path.is_file():
            raise _missing_cifar10(path, folder, "batch file")
    return _cifar10_split(files[:-1]), _cifar10_split(files[-1:])
