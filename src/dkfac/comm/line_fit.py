"""Fitting a line to measured times: least squares, with an intercept that cannot be negative.

Pure arithmetic (``math.fsum``), no torch: the cost model (:mod:`dkfac.comm.cost_model`) fits
collective and decomposition times with :func:`fit_line_nonnegative_intercept`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LineFit:
    """Least-squares line ``y = intercept + slope · x`` and its coefficient of determination."""

    intercept: float
    slope: float
    r_squared: float


def _check(xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(
            f"need at least two (x, y) points of equal count, got {len(xs)} and {len(ys)}"
        )


def _with_r_squared(
    xs: Sequence[float], ys: Sequence[float], intercept: float, slope: float
) -> LineFit:
    """``1 − SS_res/SS_tot`` (1 when every ``y`` is equal and fitted exactly)."""
    mean_y = math.fsum(ys) / len(ys)
    residual = math.fsum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    total = math.fsum((y - mean_y) ** 2 for y in ys)
    r_squared = 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
    return LineFit(intercept, slope, r_squared)


def least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """The least-squares line through ``(x, y)`` points, unclamped.

    Raises:
        ValueError: fewer than two points, counts that differ, or all ``x`` equal.
    """
    _check(xs, ys)
    mean_x, mean_y = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    spread = math.fsum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("the x values must not all be equal")
    slope = math.fsum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return _with_r_squared(xs, ys, mean_y - slope * mean_x, slope)


def fit_line_nonnegative_intercept(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """The least-squares line among those with ``intercept >= 0``.

    A start-up time cannot be negative, but the unconstrained fit of measured times can put
    it below zero: the largest sizes decide the fit, and there 1% of noise can be many times
    the start-up time (seen at 100 Mbit/s: alpha = -0.2 ms, for which SPD/PAD refused the model
    and fell back to plans by size, hiding no communication). The constrained optimum is then
    the line through the origin (the problem is convex; its optimum lies on the boundary).

    Raises:
        ValueError: as :func:`least_squares_line`, or every ``x`` zero.
    """
    line = least_squares_line(xs, ys)
    if line.intercept >= 0:
        return line
    squares = math.fsum(x * x for x in xs)
    if squares == 0:
        raise ValueError("the x values must not all be zero")
    slope = math.fsum(x * y for x, y in zip(xs, ys, strict=True)) / squares
    return _with_r_squared(xs, ys, 0.0, slope)
