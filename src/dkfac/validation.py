"""Checks of user-given values: each returns the value or raises a ``ValueError`` that names it."""

from __future__ import annotations

import math


def describe(value: object) -> str:
    """``repr(value)``, or ``callable <repr>`` for a function."""
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
    where: str = "",
) -> float:
    """Return ``value`` as a finite float, or raise a ``ValueError`` naming ``name`` and the range.

    NaN and ±inf are always refused, whatever the bounds.

    Args:
        name: parameter name used in the message.
        value: the value to check.
        low: lower bound.
        high: upper bound.
        low_open: whether ``low`` itself is excluded.
        high_open: whether ``high`` itself is excluded.
        allowed: human description of the allowed values, e.g. ``"a finite number >= 0"``.
        where: context placed after ``name=value`` in the message, e.g.
            ``" (returned by the callable at step 3)"``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={describe(value)}{where} is not allowed: expected {allowed}")
    number = float(value)
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if not math.isfinite(number) or below or above:
        raise ValueError(f"{name}={value!r}{where} is not allowed: expected {allowed}")
    return number


def check_int(name: str, value: object, *, low: int = 1, where: str = "") -> int:
    """Return ``value`` as an int ``>= low`` or raise a ``ValueError`` naming ``name``.

    Args:
        name: parameter name used in the message.
        value: the value to check.
        low: smallest allowed value.
        where: context placed after ``name=value`` in the message.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(
            f"{name}={describe(value)}{where} is not allowed: expected an integer >= {low}"
        )
    return value


def check_bool(name: str, value: object, also: str = "") -> bool:
    """``value`` if it is a bool, else a ValueError naming ``name`` (``also``: other choices)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={describe(value)} is not allowed: expected {also}True or False")
    return value


def check_switch_or_int(name: str, value: object, *, low: int) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is None, a bool or an int >= low."""
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < low:
        raise ValueError(
            f"{name}={describe(value)} is not allowed: expected None, True, False or an "
            f"integer >= {low}"
        )
