"""Validated configuration of a K-FAC preconditioner.

Every constructor argument of :class:`dkfac.KFACPreconditioner` lands here and is checked
once, at the boundary, so the rest of the library can trust it. Hyperparameters that may vary
during training (damping, learning rate...) are either a number or a callable of the K-FAC step;
callables are checked each time they are evaluated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

#: A number, or a function of the K-FAC step (0-based count of completed ``step()`` calls).
Hyperparameter = float | Callable[[int], float]
IntHyperparameter = int | Callable[[int], int]

InverseMethod = Literal["eigen", "inverse"]
LossReduction = Literal["mean", "sum"]

INVERSE_METHODS: tuple[str, ...] = ("eigen", "inverse")
LOSS_REDUCTIONS: tuple[str, ...] = ("mean", "sum")
FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


def _describe(value: object) -> str:
    return repr(value) if not callable(value) else f"callable {value!r}"


def check_float(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allowed: str,
) -> float:
    """Return ``value`` as a float, or raise a ``ValueError`` naming ``name`` and the range.

    Args:
        name: parameter name used in the message.
        value: the value to check.
        low: lower bound.
        high: upper bound.
        low_open: whether ``low`` itself is excluded.
        high_open: whether ``high`` itself is excluded.
        allowed: human description of the allowed values, e.g. ``"a number >= 0"``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={_describe(value)} is not allowed: expected {allowed}")
    number = float(value)
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if math.isnan(number) or below or above:
        raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")
    return number


def check_int(name: str, value: object, *, low: int = 1) -> int:
    """Return ``value`` as an int ``>= low`` or raise a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={_describe(value)} is not allowed: expected an integer >= {low}")
    return value


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

    def _check(self, value: object) -> float:
        return check_float(
            self.name,
            value,
            low=self.low,
            high=self.high,
            low_open=self.low_open,
            high_open=self.high_open,
            allowed=self.allowed,
        )

    def __call__(self, step: int) -> float:
        """Value at K-FAC step ``step``; a callable's result is validated like a constant."""
        if callable(self.value):
            return self._check(self.value(step))
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
            return check_int(self.name, self.value(step))
        return int(self.value)


@dataclass(frozen=True)
class KFACConfig:
    """Every knob of :class:`dkfac.KFACPreconditioner`, validated on construction.

    See the preconditioner's docstring for the meaning of each field.
    """

    strategy: str = "local"
    inverse_method: str = "eigen"
    damping: Hyperparameter = 0.003
    factor_decay: Hyperparameter = 0.95
    kl_clip: Hyperparameter | None = 0.001
    lr: Hyperparameter = 0.1
    factor_update_steps: IntHyperparameter = 1
    inv_update_steps: IntHyperparameter = 1
    accumulation_steps: int = 1
    skip_layers: Sequence[str] = ()
    loss_reduction: str = "mean"
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    grad_worker_fraction: float = 1.0
    bucket_cap_mb: float = 25.0
    comm_dtype: torch.dtype | None = None
    profile_steps: int = 5
    skip_patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False)
    damping_at: FloatSchedule = field(init=False, repr=False)
    factor_decay_at: FloatSchedule = field(init=False, repr=False)
    lr_at: FloatSchedule = field(init=False, repr=False)
    kl_clip_at: FloatSchedule | None = field(init=False, repr=False)
    factor_update_steps_at: IntSchedule = field(init=False, repr=False)
    inv_update_steps_at: IntSchedule = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.inverse_method not in INVERSE_METHODS:
            raise ValueError(
                f"inverse_method={self.inverse_method!r} is not allowed: "
                f"expected one of {', '.join(map(repr, INVERSE_METHODS))}"
            )
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction={self.loss_reduction!r} is not allowed: "
                f"expected one of {', '.join(map(repr, LOSS_REDUCTIONS))}"
            )
        for name in ("factor_dtype", "inv_dtype"):
            dtype = getattr(self, name)
            if dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"{name}={dtype!r} is not allowed: expected a floating dtype "
                    f"({', '.join(map(str, FLOAT_DTYPES))})"
                )
        if self.inv_dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"inv_dtype={self.inv_dtype!r} is not allowed: decompositions need "
                "torch.float32 or torch.float64"
            )
        check_int("accumulation_steps", self.accumulation_steps)
        check_int("profile_steps", self.profile_steps, low=0)
        check_float(
            "grad_worker_fraction",
            self.grad_worker_fraction,
            low=0.0,
            high=1.0,
            low_open=True,
            allowed="a number in (0, 1], e.g. 1/P, 2/P, ..., 1",
        )
        check_float(
            "bucket_cap_mb",
            self.bucket_cap_mb,
            low=0.0,
            allowed="a number of MiB >= 0 (0: every tensor in its own collective)",
        )
        if self.comm_dtype is not None and self.comm_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r} is not allowed: expected None or "
                f"a floating dtype ({', '.join(map(str, FLOAT_DTYPES))})"
            )
        # Building the schedules validates constant values now.
        schedules = {
            "damping_at": FloatSchedule(
                "damping",
                self.damping,
                low=0.0,
                low_open=True,
                allowed="a number > 0 or a callable of the step",
            ),
            "factor_decay_at": FloatSchedule(
                "factor_decay",
                self.factor_decay,
                low=0.0,
                high=1.0,
                high_open=True,
                allowed="a number in [0, 1) or a callable",
            ),
            "lr_at": FloatSchedule(
                "lr",
                self.lr,
                low=0.0,
                low_open=True,
                allowed="a number > 0 or a callable of the step",
            ),
            "kl_clip_at": None
            if self.kl_clip is None
            else FloatSchedule(
                "kl_clip",
                self.kl_clip,
                low=0.0,
                low_open=True,
                allowed="a number > 0, a callable of the step, or None",
            ),
            "factor_update_steps_at": IntSchedule("factor_update_steps", self.factor_update_steps),
            "inv_update_steps_at": IntSchedule("inv_update_steps", self.inv_update_steps),
        }
        for key, schedule in schedules.items():
            object.__setattr__(self, key, schedule)
        factor_steps, inv_steps = self.factor_update_steps, self.inv_update_steps
        if not callable(factor_steps) and not callable(inv_steps) and inv_steps % factor_steps:
            raise ValueError(
                f"inv_update_steps={inv_steps!r} is not allowed: expected a multiple of "
                f"factor_update_steps={factor_steps!r} (decomposing factors that have not "
                "changed would be wasted work)"
            )
        if isinstance(self.skip_layers, str):
            raise ValueError(
                f"skip_layers={self.skip_layers!r} is not allowed: expected a "
                "sequence of regular expressions, e.g. ('fc', 'Embedding')"
            )
        patterns = []
        for pattern in self.skip_layers:
            try:
                patterns.append(re.compile(pattern))
            except (re.error, TypeError) as error:
                raise ValueError(
                    f"skip_layers entry {pattern!r} is not allowed: expected a "
                    f"regular expression ({error})"
                ) from None
        object.__setattr__(self, "skip_patterns", tuple(patterns))
