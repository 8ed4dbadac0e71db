"""The ``npz`` dataset: a user's arrays from a ``.npz`` file (see :func:`load_dataset`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from dkfac.data.builtin import import_numpy
from dkfac.data.spec import DatasetSpec, fraction_option, positive_int_option

__all__ = ["load_npz"]


def load_npz(
    root: Path | None,
    seed: int,
    *,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
) -> DatasetSpec:
    """User arrays from a ``.npz`` file (see :func:`load_dataset`)."""
    if root is None:
        raise ValueError(
            "dataset 'npz' needs root= (--data-root): the path of a .npz file with arrays "
            "x and y (and optionally x_test and y_test)"
        )
    if not root.is_file():
        raise FileNotFoundError(f"npz dataset file not found: expected {root}")
    fraction = fraction_option("test_fraction", test_fraction)
    numpy = import_numpy("the npz dataset")
    try:
        with numpy.load(root, allow_pickle=False) as archive:
            arrays = {key: numpy.asarray(archive[key]) for key in archive.files}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{root} is not a readable .npz file: {exc}") from exc

    missing = [key for key in ("x", "y") if key not in arrays]
    if missing:
        raise ValueError(
            f"{root}: missing array(s) {', '.join(missing)}; expected x and y (optionally "
            f"x_test and y_test), found {', '.join(sorted(arrays)) or 'none'}"
        )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ValueError(f"{root}: x_test and y_test must be given together or not at all")

    x, y = _npz_pair(root, arrays["x"], arrays["y"], "x", "y")
    if "x_test" in arrays:
        x_test, y_test = _npz_pair(root, arrays["x_test"], arrays["y_test"], "x_test", "y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise ValueError(
                f"{root}: x_test samples have shape {tuple(x_test.shape[1:])} but x samples "
                f"have shape {tuple(x.shape[1:])}"
            )
    else:
        total = x.shape[0]
        n_test = round(total * fraction)
        if total < 2 or not 0 < n_test < total:
            raise ValueError(
                f"{root}: cannot split {total} sample(s) with test_fraction={fraction}; "
                "add samples or provide x_test and y_test"
            )
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        x, x_test = x[order[n_test:]], x[order[:n_test]]
        y, y_test = y[order[n_test:]], y[order[:n_test]]

    largest = int(torch.cat([y, y_test]).max()) if y.numel() + y_test.numel() else -1
    classes = (
        largest + 1 if num_classes is None else positive_int_option("num_classes", num_classes)
    )
    if classes <= largest or classes < 1:
        raise ValueError(
            f"num_classes={num_classes} is not allowed: {root} has label {largest}, so at least "
            f"{largest + 1} classes are needed"
        )
    if x.ndim == 3:  # (N, H, W) grayscale images
        x, x_test = x.unsqueeze(1), x_test.unsqueeze(1)
    kind = "image" if x.ndim == 4 else "vector"
    return DatasetSpec(
        "npz",
        TensorDataset(x, y),
        TensorDataset(x_test, y_test),
        tuple(int(d) for d in x.shape[1:]),
        classes,
        kind,
    )


def _npz_pair(root: Path, x: Any, y: Any, x_name: str, y_name: str) -> tuple[Tensor, Tensor]:
    """Validate and convert one ``(inputs, labels)`` pair of an npz file."""
    numpy = import_numpy("the npz dataset")
    if x.ndim < 2:
        raise ValueError(
            f"{root}: {x_name} must have shape (N, ...) with at least 2 dims, got {x.shape}"
        )
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(
            f"{root}: {y_name} must have shape ({x.shape[0]},) to match {x_name} of shape "
            f"{x.shape}, got {y.shape}"
        )
    if not (numpy.issubdtype(x.dtype, numpy.number) or x.dtype == numpy.bool_):
        raise ValueError(f"{root}: {x_name} must be numeric, got dtype {x.dtype}")
    if numpy.issubdtype(y.dtype, numpy.floating):
        if not numpy.all(numpy.isfinite(y)) or not numpy.all(y == numpy.round(y)):
            raise ValueError(f"{root}: {y_name} must hold integer class labels")
    elif not numpy.issubdtype(y.dtype, numpy.integer):
        raise ValueError(f"{root}: {y_name} must hold integer class labels, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise ValueError(f"{root}: {y_name} has negative label {y.min()}")
    inputs = torch.from_numpy(numpy.ascontiguousarray(x, dtype=numpy.float32))
    labels = torch.from_numpy(numpy.ascontiguousarray(y).astype(numpy.int64))
    return inputs, labels
