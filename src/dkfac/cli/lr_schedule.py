"""The command line's learning rate schedule: a function of how far the run has come, in epochs.

A step's rate depends on the run's progress when it starts (and, during warm-up, when it
ends), counted in examples of each epoch's order (:mod:`dkfac.cli.sampling`). The examples a
step consumes depend on the number of ranks, so a run resumed on another number continues the
same curve: a schedule counted in steps stretched or cut it (resumed from one rank on two,
every step beyond the first run's planned step count trained at rate 0 under ``cosine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def step_progress(
    epoch: int, consumed: int, step_examples: int, budget: int
) -> tuple[float, float]:
    """The epochs done where a step starts and where it ends, counted in examples.

    Args:
        epoch: the step's epoch, from 0.
        consumed: examples of the epoch's order consumed (by all ranks) before the step.
        step_examples: examples the step consumes on all ranks.
        budget: examples the epoch uses in all.

    Returns:
        ``(start, end)`` in epochs, for :meth:`EpochLR.set`.
    """
    return epoch + consumed / budget, epoch + (consumed + step_examples) / budget


@dataclass(frozen=True)
class ProgressSchedule:
    """Multiplier of the base rate as a function of progress (fractional epochs done).

    Attributes:
        schedule: ``"constant"``, ``"cosine"`` (to 0 at the last epoch's end) or ``"step"``
            (x0.1 at 1/2 and at 3/4 of the epochs), after the warm-up.
        epochs: the run's epochs.
        warmup_epochs: epochs of linear warm-up (0: none).
    """

    schedule: str
    epochs: float
    warmup_epochs: float = 0.0

    def factor(self, start: float, end: float) -> float:
        """The multiplier of a step that starts at progress ``start`` and ends at ``end``.

        The warm-up rises linearly to reach 1 where it ends (a step's rate is that of its end,
        so the first step does not train at 0); the decay is that of the step's start (the
        first step after warm-up trains at the full rate).
        """
        warmup = self.warmup_epochs
        if warmup and start < warmup:
            return min(1.0, end / warmup)
        if self.schedule == "cosine":
            span = self.epochs - warmup
            progress = (start - warmup) / span if span > 0 else 1.0
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        if self.schedule == "step":
            return 0.1 ** sum(start >= self.epochs * point for point in (0.5, 0.75))
        return 1.0


class EpochLR:
    """Sets an optimizer's rates from the run's progress before each step.

    Like PyTorch's schedulers it has ``get_last_lr``, ``state_dict`` and ``load_state_dict``;
    instead of ``step()`` after each step, :meth:`set` is called before it with the progress.

    Args:
        optimizer: its groups' current rates are the base rates.
        schedule: the multiplier as a function of progress.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: ProgressSchedule) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._last_lr = list(self.base_lrs)  # the groups' rates until the first set()

    def set(self, start: float, end: float) -> None:
        """Set every group's rate for the step about to run.

        Args:
            start: the run's epochs done where the step starts.
            end: the epochs done where it ends.
        """
        factor = self.schedule.factor(start, end)
        self._last_lr = [base * factor for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def get_last_lr(self) -> list[float]:
        """The rates last set (of the step running or just done)."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """The base rates (the progress comes from the run's position, not from here)."""
        return {"base_lrs": list(self.base_lrs), "last_lr": list(self._last_lr)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (or a ``LambdaLR``'s, which also has ``base_lrs``).

        The rate last set matters only until the next :meth:`set` (an epoch's summary when the
        checkpoint was written at its end); a ``LambdaLR``'s is the next step's rate.

        Raises:
            ValueError: the state has no base rate for each of the optimizer's groups.
        """
        bases = state.get("base_lrs")
        groups = len(self.optimizer.param_groups)
        if not isinstance(bases, list) or len(bases) != groups:
            raise ValueError(
                f"the checkpoint's learning rate schedule has no base rate for each of the "
                f"optimizer's {groups} parameter group(s): {state!r}"
            )
        self.base_lrs = [float(base) for base in bases]
        last = state.get("last_lr", state.get("_last_lr"))
        if isinstance(last, list) and len(last) == groups:
            self._last_lr = [float(lr) for lr in last]
