"""Small, download-free datasets for demos, tests and benchmarks."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset

logger = logging.getLogger(__name__)

__all__ = ["load_digits_tensors", "synthetic_images"]

_DIGITS_MAX_VALUE = 16.0
"""Pixel values of scikit-learn's digits are integers in ``[0, 16]``."""


def load_digits_tensors(
    test_fraction: float = 0.25,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    standardize: bool = True,
) -> tuple[TensorDataset, TensorDataset]:
    """Load scikit-learn's 8x8 handwritten digits as train and test tensor datasets.

    The 1797 images ship with scikit-learn, so nothing is downloaded. Images are
    returned with shape ``(N, 1, 8, 8)``: pixels are first scaled to ``[0, 1]`` and then
    (``standardize``) standardized with the scalar mean and standard deviation of the
    *training* split (the test split uses the same statistics). The split is stratified by
    class and fully determined by ``seed``.

    Args:
        test_fraction: Fraction of the samples that goes to the test split, in
            ``(0, 1)``.
        seed: Seed of the split.
        dtype: Floating-point dtype of the images; labels are always ``torch.long``.
        standardize: standardize the pixels; ``False`` keeps them in ``[0, 1]`` (targets
            of an autoencoder).

    Returns:
        ``(train, test)`` datasets, each yielding ``(image, label)`` pairs.

    Raises:
        ImportError: If scikit-learn is not installed.
        ValueError: If ``test_fraction`` is not in ``(0, 1)`` or ``dtype`` is not a
            floating-point dtype.

    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError(
            'load_digits_tensors requires scikit-learn; install it with pip install "dkfac[data]"'
        ) from exc

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float64) / _DIGITS_MAX_VALUE
    images = images.unsqueeze(1)
    labels = torch.as_tensor(digits.target, dtype=torch.long)

    indices = list(range(labels.numel()))
    train_idx, test_idx = train_test_split(
        indices,
        test_size=test_fraction,
        random_state=seed,
        stratify=labels.numpy(),
    )
    train_index = torch.as_tensor(train_idx, dtype=torch.long)
    test_index = torch.as_tensor(test_idx, dtype=torch.long)

    train_images = images[train_index]
    mean = train_images.mean() if standardize else torch.tensor(0.0, dtype=torch.float64)
    std = train_images.std().clamp_min(1e-12) if standardize else torch.tensor(1.0)

    def _standardize(x: torch.Tensor) -> torch.Tensor:
        return ((x - mean) / std).to(dtype)

    train = TensorDataset(_standardize(train_images), labels[train_index])
    test = TensorDataset(_standardize(images[test_index]), labels[test_index])
    logger.debug(
        "Loaded digits: %d train / %d test samples (mean=%.4f, std=%.4f)",
        train_index.numel(),
        test_index.numel(),
        float(mean),
        float(std),
    )
    return train, test


def synthetic_images(
    n: int,
    shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> TensorDataset:
    """Return a dataset of standard-normal images with uniformly random labels.

    Useful for shape checks and throughput benchmarks; the labels carry no signal.

    Args:
        n: Number of samples.
        shape: Shape of one sample, e.g. ``(3, 32, 32)``.
        num_classes: Labels are drawn uniformly from ``range(num_classes)``.
        seed: Seed of a private generator (the global RNG is left untouched).
        dtype: Floating-point dtype of the images.

    Returns:
        A dataset of ``(image, label)`` pairs with images of shape ``(n, *shape)``.

    Raises:
        ValueError: If ``n`` is negative or ``num_classes`` is not positive.

    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn((n, *shape), generator=generator, dtype=dtype)
    labels = torch.randint(0, num_classes, (n,), generator=generator, dtype=torch.long)
    return TensorDataset(images, labels)


def import_numpy(purpose: str) -> Any:
    """Import numpy lazily (it is not a hard dependency of dkfac)."""
    try:
        import numpy
    except ImportError as exc:  # pragma: no cover - numpy ships with scikit-learn
        raise ImportError(f"{purpose} requires numpy; install it with pip install numpy") from exc
    return numpy
