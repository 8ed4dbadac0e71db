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
``pysource``   Characters of the Python standard library's own sources, next-character labels.
=============  ==============================================================================

Nothing is ever downloaded: ``cifar10`` reads files that are already on disk and says
where it expected them when they are missing.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from dkfac.data.builtin import load_digits_tensors
from dkfac.data.cifar10 import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    default_cifar10_root,
    load_cifar10,
)
from dkfac.data.npz import load_npz
from dkfac.data.spec import DATASET_KINDS, DatasetSpec, fraction_option, positive_int_option
from dkfac.data.stdlib_text import VOCAB_SIZE, load_stdlib_text

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

DATASET_NAMES: tuple[str, ...] = ("digits", "synthetic", "cifar10", "npz", "tokens", "pysource")
"""Names accepted by :func:`load_dataset`."""


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
    * ``pysource``: ``seq_len`` (64), ``valid_fraction`` (0.1), ``max_chars`` (all): windows
      of this interpreter's standard-library sources, a fixed list of modules, each file
      split at ``1 - valid_fraction`` of its length (:mod:`dkfac.data.stdlib_text`); kind
      ``text``, 128 token ids. ``root`` is ignored; ``seed`` too (a fixed split).

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
        "npz": load_npz,
        "pysource": _load_pysource,
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
        "pysource": frozenset({"seq_len", "valid_fraction", "max_chars"}),
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


# -- digits and synthetic -----------------------------------------------------------------


def _load_digits(_root: Path | None, seed: int, *, test_fraction: float = 0.25) -> DatasetSpec:
    """scikit-learn's digits through :func:`dkfac.data.builtin.load_digits_tensors`."""
    train, test = load_digits_tensors(
        test_fraction=fraction_option("test_fraction", test_fraction), seed=seed
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
    classes = positive_int_option("num_classes", num_classes)
    n_train = positive_int_option("train_size", train_size)
    n_test = positive_int_option("test_size", test_size)
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
    vocab = positive_int_option("vocab_size", vocab_size)
    length = positive_int_option("seq_len", seq_len)
    classes = positive_int_option("num_classes", num_classes)
    n_train = positive_int_option("train_size", train_size)
    n_test = positive_int_option("test_size", test_size)
    position = positive_int_option("key_position", key_position, minimum=0)
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


# -- pysource ------------------------------------------------------------------------------


def _load_pysource(
    _root: Path | None,
    _seed: int,
    *,
    seq_len: int = 64,
    valid_fraction: float = 0.1,
    max_chars: int | None = None,
) -> DatasetSpec:
    """The standard library's text (:func:`~dkfac.data.stdlib_text.load_stdlib_text`)."""
    length = positive_int_option("seq_len", seq_len)
    if max_chars is not None:
        positive_int_option("max_chars", max_chars, minimum=length + 1)
    train, valid = load_stdlib_text(length, valid_fraction, max_chars)
    return DatasetSpec(
        "pysource", train, valid, (length,), VOCAB_SIZE, "text", vocab_size=VOCAB_SIZE
    )
