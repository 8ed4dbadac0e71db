"""Hyperparameters that may change during training: a number or a function of the K-FAC step.

A constant is checked once, when given; a callable's value each time it is evaluated, with
the step that returned it named in the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dkfac.validation import check_float, check_int

#: A number, or a function of the K-FAC step (0-based count of completed ``step()`` calls).
Hyperparameter = float | Callable[[int], float]
IntHyperparameter = int | Callable[[int], int]


def check_multiple(factor_steps: int, inv_steps: int, step: int | None = None) -> None:
    """Raise a ``ValueError`` unless ``inv_steps`` is a multiple of ``factor_steps``.

    Args:
        factor_steps: value of ``factor_update_steps``.
        inv_steps: value of ``inv_update_steps``.
        step: the K-FAC step both values were returned for (callables), named in the message.
    """
    if inv_steps % factor_steps:
        where = "" if step is None else f" (at step {step})"
        same = "" if step is None else " at that step"
        raise ValueError(
            f"inv_update_steps={inv_steps!r}{where} is not allowed: expected a multiple of "
            f"factor_update_steps={factor_steps!r}{same} (decomposing factors that have not "
            "changed would be wasted work)"
        )


def _at_step(step: int) -> str:
    return f" (returned by the callable at step {step})"


@dataclass(frozen=True)
class FloatSchedule:
    """A float hyperparameter: a constant or a function of the K-FAC step, range-checked."""

    name: str
    value: Hyperparameter
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    allowed: str = ""

    def __post_init__(self) -> None:
        if not callable(self.value):
            self._check(self.value)

    def _check(self, value: object, where: str = "") -> float:
        return check_float(
            self.name,
            value,
            low=self.low,
            high=self.high,
            low_open=self.low_open,
            high_open=self.high_open,
            allowed=self.allowed,
            where=where,
        )

    def __call__(self, step: int) -> float:
        """Value at K-FAC step ``step``; a callable's result is validated like a constant."""
        if callable(self.value):
            return self._check(self.value(step), _at_step(step))
        return float(self.value)


@dataclass(frozen=True)
class IntSchedule:
    """An integer interval (steps between updates): a constant or a function of the step."""

    name: str
    value: IntHyperparameter

    def __post_init__(self) -> None:
        if not callable(self.value):
            check_int(self.name, self.value)

    def __call__(self, step: int) -> int:
        """Value at K-FAC step ``step``."""
        if callable(self.value):
            return check_int(self.name, self.value(step), where=_at_step(step))
        return int(self.value)
