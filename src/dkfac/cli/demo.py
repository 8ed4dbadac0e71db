"""Compare SGD with and without K-FAC on scikit-learn's digits.

Run ``python -m dkfac.cli.demo``. The script trains :class:`~dkfac.models.SmallCNN` twice
from the same initialization and the same mini-batch order: once with SGD with
momentum, once with the same optimizer preconditioned by
:class:`dkfac.KFACPreconditioner`. It prints the test accuracy after every epoch, the
wall time of each run and the first epoch at which each run reached 95% test accuracy.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dkfac.data.builtin import load_digits_tensors
from dkfac.models import SmallCNN

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_KFAC_KWARGS",
    "TARGET_ACCURACY",
    "DigitsRun",
    "evaluate",
    "first_epoch_reaching",
    "format_table",
    "main",
    "run_digits",
    "train_digits",
]

TARGET_ACCURACY = 0.95
"""Test accuracy whose first crossing the demo reports."""

DEFAULT_KFAC_KWARGS: Mapping[str, Any] = {
    "damping": 0.003,
    "factor_decay": 0.95,
    "kl_clip": 0.001,
    "factor_update_steps": 1,
    "inv_update_steps": 1,
}
"""Keyword arguments passed to :class:`dkfac.KFACPreconditioner` (besides ``lr``)."""

_MOMENTUM = 0.9


@dataclass
class DigitsRun:
    """Outcome of one training run on the digits data.

    Attributes:
        name: Label of the run, e.g. ``"SGD"`` or ``"SGD+K-FAC"``.
        accuracies: Test accuracy (in ``[0, 1]``) after each epoch.
        wall_time: Seconds spent training and evaluating.

    """

    name: str
    accuracies: list[float] = field(default_factory=list)
    wall_time: float = 0.0

    @property
    def first_epoch_at_target(self) -> int | None:
        """First 1-based epoch with test accuracy >= :data:`TARGET_ACCURACY`, if any."""
        return first_epoch_reaching(self.accuracies, TARGET_ACCURACY)


def first_epoch_reaching(accuracies: Sequence[float], target: float) -> int | None:
    """Return the first 1-based epoch whose accuracy is at least ``target``.

    Args:
        accuracies: Accuracy after each epoch.
        target: Threshold to reach.

    Returns:
        The epoch number, or ``None`` if the threshold is never reached.

    """
    for epoch, accuracy in enumerate(accuracies, start=1):
        if accuracy >= target:
            return epoch
    return None


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, batch_size: int = 512) -> float:
    """Return the classification accuracy of ``model`` on ``dataset``.

    The model is put in eval mode for the evaluation and its previous mode is restored.

    Args:
        model: Classifier returning logits.
        dataset: Dataset of ``(inputs, labels)`` tensors.
        batch_size: Number of samples per forward pass.

    Returns:
        Fraction of correctly classified samples, in ``[0, 1]``.

    """
    inputs, labels = dataset.tensors
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, labels.numel(), batch_size):
            logits = model(inputs[start : start + batch_size])
            correct += int((logits.argmax(dim=1) == labels[start : start + batch_size]).sum())
    finally:
        model.train(was_training)
    return correct / max(labels.numel(), 1)


def _make_preconditioner(model: nn.Module, lr: float, kfac_kwargs: Mapping[str, Any]) -> Any:
    """Build a K-FAC preconditioner for ``model`` (imported lazily)."""
    import dkfac

    kwargs = {"lr": lr, **DEFAULT_KFAC_KWARGS, **kfac_kwargs}
    return dkfac.KFACPreconditioner(model, **kwargs)


def run_digits(
    use_kfac: bool,
    epochs: int = 10,
    lr: float = 0.05,
    batch_size: int = 64,
    seed: int = 0,
    kfac_kwargs: Mapping[str, Any] | None = None,
    data: tuple[TensorDataset, TensorDataset] | None = None,
) -> DigitsRun:
    """Train :class:`~dkfac.models.SmallCNN` on the digits and time it.

    The initialization and the mini-batch order depend only on ``seed``, so runs that
    differ only in ``use_kfac`` start from identical weights and see identical batches.

    Args:
        use_kfac: Whether to precondition the gradients with K-FAC before each
            optimizer step.
        epochs: Number of passes over the training split.
        lr: Learning rate of SGD (and the ``lr`` given to the preconditioner).
        batch_size: Mini-batch size.
        seed: Seed of the initialization and of the shuffling.
        kfac_kwargs: Overrides of :data:`DEFAULT_KFAC_KWARGS`; ignored without K-FAC.
        data: ``(train, test)`` datasets; loaded with :func:`load_digits_tensors` when
            omitted.

    Returns:
        The per-epoch test accuracies and the wall time.

    Raises:
        ValueError: If ``epochs`` is negative or ``batch_size`` is not positive.

    """
    if epochs < 0:
        raise ValueError(f"epochs must be non-negative, got {epochs}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    train, test = data if data is not None else load_digits_tensors(seed=0)
    train_x, train_y = train.tensors

    torch.manual_seed(seed)
    model = SmallCNN(in_channels=train_x.shape[1], num_classes=10).to(train_x.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=_MOMENTUM)
    preconditioner = _make_preconditioner(model, lr, kfac_kwargs or {}) if use_kfac else None
    shuffle = torch.Generator().manual_seed(seed)

    result = DigitsRun(name="SGD+K-FAC" if use_kfac else "SGD")
    start = time.perf_counter()
    model.train()
    for epoch in range(1, epochs + 1):
        order = torch.randperm(train_y.numel(), generator=shuffle)
        for begin in range(0, order.numel(), batch_size):
            index = order[begin : begin + batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            # Same as loss.backward(); Tensor.backward is untyped in torch's stubs.
            torch.autograd.backward(loss)
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
        accuracy = evaluate(model, test)
        result.accuracies.append(accuracy)
        logger.info("%s epoch %d: test accuracy %.4f", result.name, epoch, accuracy)
    result.wall_time = time.perf_counter() - start
    return result


def train_digits(
    use_kfac: bool,
    epochs: int = 10,
    lr: float = 0.05,
    batch_size: int = 64,
    seed: int = 0,
    kfac_kwargs: Mapping[str, Any] | None = None,
) -> list[float]:
    """Train on the digits and return the test accuracy after each epoch.

    Thin wrapper around :func:`run_digits`; see there for the arguments.

    Args:
        use_kfac: Whether to precondition the gradients with K-FAC.
        epochs: Number of passes over the training split.
        lr: Learning rate.
        batch_size: Mini-batch size.
        seed: Seed of the initialization and of the shuffling.
        kfac_kwargs: Overrides of :data:`DEFAULT_KFAC_KWARGS`.

    Returns:
        Test accuracy (in ``[0, 1]``) after each epoch.

    """
    return run_digits(
        use_kfac,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        kfac_kwargs=kfac_kwargs,
    ).accuracies


def format_table(runs: Sequence[DigitsRun]) -> str:
    """Render per-epoch test accuracies, wall times and epochs-to-target as text.

    Args:
        runs: The runs to compare, one column each.

    Returns:
        A multi-line table.

    """
    width = max([12, *(len(run.name) + 2 for run in runs)])
    epochs = max((len(run.accuracies) for run in runs), default=0)
    lines = ["epoch".ljust(8) + "".join(run.name.rjust(width) for run in runs)]
    lines.append("-" * len(lines[0]))
    for epoch in range(epochs):
        cells = (
            f"{run.accuracies[epoch]:.2%}" if epoch < len(run.accuracies) else "" for run in runs
        )
        lines.append(str(epoch + 1).ljust(8) + "".join(cell.rjust(width) for cell in cells))
    lines.append("-" * len(lines[0]))
    lines.append("time".ljust(8) + "".join(f"{run.wall_time:.2f} s".rjust(width) for run in runs))
    reached = (run.first_epoch_at_target for run in runs)
    lines.append(
        f">={TARGET_ACCURACY:.0%}".ljust(8)
        + "".join(("never" if e is None else f"epoch {e}").rjust(width) for e in reached)
    )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m dkfac.cli.demo",
        description="Train a small CNN on scikit-learn's digits with SGD and SGD+K-FAC.",
    )
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run (default 10)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and shuffling")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print the results.

    Args:
        argv: Command-line arguments; ``sys.argv[1:]`` when ``None``.

    Returns:
        The process exit status.

    """
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    data = load_digits_tensors(seed=0)
    runs = []
    for use_kfac in (False, True):
        run = run_digits(
            use_kfac,
            epochs=args.epochs,
            lr=args.lr,
            batch_size=args.batch_size,
            seed=args.seed,
            data=data,
        )
        runs.append(run)
        print(f"finished {run.name} in {run.wall_time:.2f} s", flush=True)
    print()
    print(
        f"digits: {len(data[0])} train / {len(data[1])} test samples, "
        f"lr={args.lr}, batch size={args.batch_size}, seed={args.seed}, "
        f"threads={torch.get_num_threads()}"
    )
    print(format_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
