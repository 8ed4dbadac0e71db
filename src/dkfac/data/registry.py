"""Named datasets for ``dkfac train --dataset NAME``.

:func:`load_dataset` turns a name (one of :data:`DATASET_NAMES`) into a
:class:`DatasetSpec`: train and test datasets of ``(input, label)`` pairs plus what a
model needs to know about them (input shape, number of classes, kind of input).

=============  ==============================================================================
name           data
=============  ==============================================================================
``digits``     scikit-learn's bundled 8x8 handwritten digits, ``(1, 8, 8)``, 10 classes.
``synthetic``  Gaussian images whose label is the argmax of a fixed random linear map.
``cifar10``    CIFAR-10 from the local *python* batches (never downloaded).
``npz``        User arrays ``x``/``y`` (optionally ``x_test``/``y_test``) from a ``.npz``.
``tokens``     Random token sequences labelled by the token at a fixed position.
=============  ==============================================================================

Nothing is ever downloaded: ``cifar10`` reads files that are already on disk and says
where it expected them when they are missing.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from dkfac.data.builtin import import_numpy, load_digits_tensors
from dkfac.data.cifar10 import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    default_cifar10_root,
    load_cifar10,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATASET_KINDS",
    "DATASET_NAMES",
    "DatasetSpec",
    "default_cifar10_root",
    "load_dataset",
]

DATASET_NAMES: tuple[str, ...] = ("digits", "synthetic", "cifar10", "npz", "tokens")
"""Names accepted by :func:`load_dataset`."""

DATASET_KINDS: tuple[str, ...] = ("image", "vector", "tokens")
"""Kinds of input: ``image`` is ``(C, H, W)`` floats, ``vector`` any other float
features, ``tokens`` a sequence of integer token ids."""


@dataclass(frozen=True)
class DatasetSpec:
    """A loaded dataset and what a model needs to know about it.

    Attributes:
        name: Registry name the dataset was loaded under.
        train: Training split of ``(input, label)`` pairs.
        test: Test split of ``(input, label)`` pairs.
        input_shape: Shape of one input, without the batch dimension (e.g.
            ``(3, 32, 32)`` for images or ``(seq_len,)`` for tokens).
        num_classes: Number of classes; labels are in ``range(num_classes)``.
        kind: One of :data:`DATASET_KINDS`.
        vocab_size: Number of distinct token ids for ``kind == "tokens"``, else ``None``.

    """

    name: str
    train: Dataset[tuple[Tensor, ...]]
    test: Dataset[tuple[Tensor, ...]]
    input_shape: tuple[int, ...]
    num_classes: int
    kind: str
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise ValueError(f"kind={self.kind!r} is not allowed: expected one of {DATASET_KINDS}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be positive, got {self.num_classes}")
        if self.kind == "tokens" and (self.vocab_size is None or self.vocab_size < 1):
            raise ValueError(f"a tokens dataset needs a positive vocab_size, got {self.vocab_size}")


def load_dataset(
    name: str, *, root: str | os.PathLike[str] | None = None, seed: int = 0, **options: Any
) -> DatasetSpec:
    """Load the dataset registered under ``name``.

    Options per dataset (all optional unless stated):

    * ``digits``: ``test_fraction`` (0.25). ``root`` is ignored.
    * ``synthetic``: ``shape`` ((3, 32, 32)), ``num_classes`` (10), ``train_size`` (1024),
      ``test_size`` (256). Inputs are standard normal; the label of ``x`` is
      ``argmax(W @ x.flatten())`` for a fixed random matrix ``W``, so a model can learn it.
      ``root`` is ignored.
    * ``cifar10``: ``root`` is the folder holding ``data_batch_1`` ... ``data_batch_5``
      and ``test_batch`` (or a folder containing ``cifar-10-batches-py``); by default
      ``$DKFAC_DATA`` or ``~/.cache/dkfac/cifar-10-batches-py``. Images are scaled to
      ``[0, 1]`` and normalized per channel with :data:`CIFAR10_MEAN` and
      :data:`CIFAR10_STD`. No options.
    * ``npz``: ``root`` (required) is the path of a ``.npz`` file with arrays ``x`` and
      ``y`` and optionally ``x_test`` and ``y_test``; without them a seeded split keeps
      ``test_fraction`` (0.2) of the samples for testing. ``num_classes`` defaults to the
      largest label plus one. Inputs of shape ``(N, H, W)`` get a channel dimension and
      count as images, as do ``(N, C, H, W)``; other shapes are ``vector`` features.
    * ``tokens``: ``vocab_size`` (32), ``seq_len`` (32), ``num_classes`` (8),
      ``train_size`` (2048), ``test_size`` (512), ``key_position`` (0). Tokens are uniform
      over ``range(vocab_size)``; the label is ``tokens[key_position] % num_classes``, so a
      model must find one position and read the token there (a task for attention and
      positional embeddings). ``root`` is ignored.

    Every dataset is fully determined by ``seed`` (and the files it reads).

    Args:
        name: One of :data:`DATASET_NAMES`.
        root: Data location for ``cifar10`` and ``npz`` (see above).
        seed: Seed of the random data and of random splits; the global RNG is untouched.
        **options: Dataset-specific options listed above.

    Returns:
        The loaded dataset with its metadata.

    Raises:
        ValueError: If ``name`` is unknown, an option is not accepted by the dataset or has
            an invalid value, or a data file is malformed.
        FileNotFoundError: If a data file or folder does not exist.
        ImportError: If an optional dependency (scikit-learn, numpy) is missing.

    """
    loaders: Mapping[str, Callable[..., DatasetSpec]] = {
        "digits": _load_digits,
        "synthetic": _load_synthetic,
        "cifar10": _load_cifar10,
        "npz": _load_npz,
        "tokens": _load_tokens,
    }
    allowed: Mapping[str, frozenset[str]] = {
        "digits": frozenset({"test_fraction"}),
        "synthetic": frozenset({"shape", "num_classes", "train_size", "test_size"}),
        "cifar10": frozenset(),
        "npz": frozenset({"test_fraction", "num_classes"}),
        "tokens": frozenset(
            {"vocab_size", "seq_len", "num_classes", "train_size", "test_size", "key_position"}
        ),
    }
    if name not in loaders:
        raise ValueError(
            f"dataset={name!r} is not allowed: expected one of {', '.join(DATASET_NAMES)}"
        )
    unknown = sorted(set(options) - allowed[name])
    if unknown:
        accepted = ", ".join(sorted(allowed[name])) or "none"
        raise ValueError(
            f"option(s) {', '.join(unknown)} not accepted by dataset {name!r} "
            f"(accepted: {accepted})"
        )
    path = None if root is None else Path(root).expanduser()
    if path is not None and name not in ("cifar10", "npz"):
        logger.debug("dataset %r reads no files; ignoring root=%s", name, path)
    spec = loaders[name](path, seed, **options)
    logger.info(
        "Loaded dataset %r: %d train / %d test samples, input %s, %d classes",
        name,
        _length(spec.train),
        _length(spec.test),
        spec.input_shape,
        spec.num_classes,
    )
    return spec


# -- helpers ------------------------------------------------------------------------------


def _length(dataset: Dataset[tuple[Tensor, ...]]) -> int:
    """``len(dataset)``, or -1 for datasets without a length."""
    size = getattr(dataset, "__len__", None)
    return int(size()) if callable(size) else -1


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Validate an integer option (booleans are rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {minimum}")
    return value


def _fraction(name: str, value: Any) -> float:
    """Validate a fraction option in ``(0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number in (0, 1)")
    return float(value)


# -- digits and synthetic -----------------------------------------------------------------


def _load_digits(_root: Path | None, seed: int, *, test_fraction: float = 0.25) -> DatasetSpec:
    """scikit-learn's digits through :func:`dkfac.data.builtin.load_digits_tensors`."""
    train, test = load_digits_tensors(
        test_fraction=_fraction("test_fraction", test_fraction), seed=seed
    )
    return DatasetSpec("digits", train, test, (1, 8, 8), 10, "image")


def _load_synthetic(
    _root: Path | None,
    seed: int,
    *,
    shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    train_size: int = 1024,
    test_size: int = 256,
) -> DatasetSpec:
    """Gaussian inputs labelled by the argmax of a fixed random linear map."""
    sizes = (shape,) if isinstance(shape, int) else tuple(shape)
    if not sizes or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in sizes):
        raise ValueError(f"shape={shape!r} is not allowed: expected a tuple of positive integers")
    dims: tuple[int, ...] = sizes
    classes = _positive_int("num_classes", num_classes)
    n_train = _positive_int("train_size", train_size)
    n_test = _positive_int("test_size", test_size)
    generator = torch.Generator().manual_seed(seed)
    features = math.prod(dims)
    weight = torch.randn(features, classes, generator=generator) / math.sqrt(features)

    def _draw(n: int) -> TensorDataset:
        inputs = torch.randn((n, *dims), generator=generator)
        labels = (inputs.reshape(n, features) @ weight).argmax(dim=1)
        return TensorDataset(inputs, labels)

    train = _draw(n_train)
    test = _draw(n_test)
    kind = "image" if len(dims) == 3 else "vector"
    return DatasetSpec("synthetic", train, test, dims, classes, kind)


# -- tokens -------------------------------------------------------------------------------


def _load_tokens(
    _root: Path | None,
    seed: int,
    *,
    vocab_size: int = 32,
    seq_len: int = 32,
    num_classes: int = 8,
    train_size: int = 2048,
    test_size: int = 512,
    key_position: int = 0,
) -> DatasetSpec:
    """Uniform token sequences labelled by ``tokens[key_position] % num_classes``."""
    vocab = _positive_int("vocab_size", vocab_size)
    length = _positive_int("seq_len", seq_len)
    classes = _positive_int("num_classes", num_classes)
    n_train = _positive_int("train_size", train_size)
    n_test = _positive_int("test_size", test_size)
    position = _positive_int("key_position", key_position, minimum=0)
    if position >= length:
        raise ValueError(
            f"key_position={position} is not allowed: expected 0 <= key_position < seq_len={length}"
        )
    if classes > vocab:
        raise ValueError(
            f"num_classes={classes} is not allowed: it exceeds vocab_size={vocab}, so some "
            "classes could never occur"
        )
    generator = torch.Generator().manual_seed(seed)

    def _draw(n: int) -> TensorDataset:
        tokens = torch.randint(0, vocab, (n, length), generator=generator, dtype=torch.long)
        return TensorDataset(tokens, tokens[:, position] % classes)

    train = _draw(n_train)
    test = _draw(n_test)
    return DatasetSpec("tokens", train, test, (length,), classes, "tokens", vocab_size=vocab)


# -- cifar10 ------------------------------------------------------------------------------


def _load_cifar10(root: Path | None, _seed: int) -> DatasetSpec:
    """CIFAR-10 from the python batches in ``root`` (fixed split, so no seed)."""
    train, test = load_cifar10(root)
    return DatasetSpec("cifar10", train, test, (3, 32, 32), CIFAR10_CLASSES, "image")


# -- npz ----------------------------------------------------------------------------------


def _load_npz(
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
    fraction = _fraction("test_fraction", test_fraction)
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
    classes = largest + 1 if num_classes is None else _positive_int("num_classes", num_classes)
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
