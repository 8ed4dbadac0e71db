"""The three tasks of the time-to-target benchmark, on data every machine has.

========================  ===============================================  ====================
workload                  model and data                                   target
========================  ===============================================  ====================
``digits``                :class:`~dkfac.models.SmallCNN`, scikit-learn's  test accuracy >= 97%
                          digits (1347 train / 450 test images)
``autoencoder``           :class:`~dkfac.models.DeepAutoencoder`           test squared error
                          (64-1000-500-250-30 and back, Martens' sparse    per image <= 1.0
                          initialisation), the same digits as pixels in    (the mean image:
                          [0, 1]                                           4.7)
``charlm``                :class:`~dkfac.models.TransformerLM` (2 blocks,  validation loss
                          width 64), characters of the standard library's  <= 1.4 nats/char
                          sources (``pysource``, 256k training characters)
========================  ===============================================  ====================

Every workload is built from its name alone (each worker process of a distributed run builds
its own copy): :func:`load_workload`. Its global batch may be changed (``batch_size=``), the
same for every method, to measure how the methods' rankings move with the batch: second-order
methods are expected to need fewer steps than first-order ones the larger it is (Zhang et al.,
2019, "Which algorithmic choices matter at which batch sizes?").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.cli.objective import label_cross_entropy
from dkfac.data.builtin import load_digits_tensors
from dkfac.data.stdlib_text import VOCAB_SIZE, load_stdlib_text
from dkfac.models import DeepAutoencoder, SmallCNN, TransformerLM

__all__ = ["WORKLOADS", "Workload", "load_workload"]

#: Names of the workloads, in the order the benchmark runs them.
WORKLOADS: tuple[str, ...] = ("digits", "autoencoder", "charlm")

Loss = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Workload:
    """A task: data, a model builder, its training loss and the measure of its target.

    Attributes:
        name: one of :data:`WORKLOADS`.
        train: ``(inputs, targets)`` of the training split.
        test: ``(inputs, targets)`` the target is measured on.
        build: a fresh model (call after seeding).
        loss_fn: the training loss of a batch (a mean).
        measure: the metric of a model on ``test`` (evaluated without gradients).
        metric: what ``measure`` returns, in words.
        target: the value to reach.
        higher_is_better: whether reaching means ``>= target`` (else ``<= target``).
        batch_size: the global batch (split over workers).
        eval_every: optimizer steps between two measurements.
        budget_s: training seconds a run may take before it counts as not reaching the target.
    """

    name: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    build: Callable[[], nn.Module]
    loss_fn: Loss
    measure: Callable[[nn.Module, tuple[Tensor, Tensor]], float]
    metric: str
    target: float
    higher_is_better: bool
    batch_size: int
    eval_every: int
    budget_s: float

    def reached(self, value: float) -> bool:
        """Whether ``value`` of the metric meets the target."""
        return value >= self.target if self.higher_is_better else value <= self.target


def _accuracy(model: nn.Module, data: tuple[Tensor, Tensor]) -> float:
    x, y = data
    return float((model(x).argmax(-1) == y).double().mean())


def _squared_error(model: nn.Module, data: tuple[Tensor, Tensor]) -> float:
    x, _ = data
    reconstruction = torch.sigmoid(model(x))
    return float((reconstruction - x.flatten(1)).pow(2).sum(1).mean())


def _token_loss(model: nn.Module, data: tuple[Tensor, Tensor]) -> float:
    x, y = data
    total = 0.0
    for start in range(0, x.shape[0], 256):  # bounded memory for the logits
        batch = slice(start, start + 256)
        total += float(label_cross_entropy(model(x[batch]), y[batch], reduction="sum"))
    return total / y.numel()


def _reconstruction_loss(logits: Tensor, inputs: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(logits, inputs.flatten(1))


def _tensors(dataset: torch.utils.data.TensorDataset) -> tuple[Tensor, Tensor]:
    x, y = dataset.tensors
    return x, y


def load_workload(name: str, batch_size: int | None = None) -> Workload:
    """The workload called ``name`` (see the module).

    Args:
        name: one of :data:`WORKLOADS`.
        batch_size: its global batch instead of the workload's own (``None``); at most the
            training examples (a batch is drawn without replacement from one permutation).

    Raises:
        ValueError: an unknown name, or a batch that is not a positive number of examples the
            training split has.
    """
    workload = _named_workload(name)
    if batch_size is None:
        return workload
    examples = len(workload.train[0])
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
    if batch_size > examples:
        raise ValueError(
            f"batch_size={batch_size} for workload {name!r}: its training split has "
            f"{examples} examples"
        )
    return replace(workload, batch_size=batch_size)


def _named_workload(name: str) -> Workload:
    if name == "digits":
        train, test = load_digits_tensors()
        return Workload(
            name,
            _tensors(train),
            _tensors(test),
            lambda: SmallCNN(),
            F.cross_entropy,
            _accuracy,
            "test accuracy",
            0.97,
            True,
            batch_size=64,
            eval_every=10,
            budget_s=20.0,
        )
    if name == "autoencoder":
        train, test = load_digits_tensors(standardize=False)
        x_train, x_test = train.tensors[0].flatten(1), test.tensors[0].flatten(1)
        return Workload(
            name,
            (x_train, x_train),
            (x_test, x_test),
            lambda: DeepAutoencoder(64),
            _reconstruction_loss,
            _squared_error,
            "test squared error per image",
            1.0,
            False,
            batch_size=128,
            eval_every=20,
            budget_s=60.0,
        )
    if name == "charlm":
        train_text, valid_text = load_stdlib_text(seq_len=64, max_chars=256_000)
        return Workload(
            name,
            _tensors(train_text),
            _tensors(valid_text),
            lambda: TransformerLM(VOCAB_SIZE, d_model=64, heads=4, layers=2, seq_len=64),
            label_cross_entropy,
            _token_loss,
            "validation loss (nats per character)",
            1.4,
            False,
            batch_size=32,
            eval_every=25,
            budget_s=60.0,
        )
    raise ValueError(f"workload={name!r} is not allowed: expected one of {', '.join(WORKLOADS)}")
