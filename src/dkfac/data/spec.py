"""What a loaded dataset is: :class:`DatasetSpec`, and the checks of dataset options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DATASET_KINDS", "DatasetSpec", "fraction_option", "positive_int_option"]

DATASET_KINDS: tuple[str, ...] = ("image", "vector", "tokens", "text")
"""Kinds of input: ``image`` is ``(C, H, W)`` floats, ``vector`` any other float
features, ``tokens`` a sequence of integer token ids with one class label, ``text`` a
sequence of token ids whose labels are the next token at every position (a language model's
data: ``num_classes`` is the vocabulary)."""


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
        if self.kind in ("tokens", "text") and (self.vocab_size is None or self.vocab_size < 1):
            raise ValueError(f"a tokens dataset needs a positive vocab_size, got {self.vocab_size}")


def positive_int_option(name: str, value: Any, minimum: int = 1) -> int:
    """Validate an integer option (booleans are rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {minimum}")
    return value


def fraction_option(name: str, value: Any) -> float:
    """Validate a fraction option in ``(0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number in (0, 1)")
    return float(value)
