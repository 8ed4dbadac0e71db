"""The quadratic model of one step, and the Levenberg-Marquardt rule that damps it (pure math).

The update is a combination ``δ = Σᵢ cᵢ·vᵢ`` of a few vectors (the K-FAC direction and the
previous update). In their span the damped quadratic model of the loss,
``M(δ) = ∇hᵀδ + ½·δᵀ(C + λI)δ``, is a function of the coefficients ``c`` alone:
``M(c) = bᵀc + ½·cᵀ(K + λ·V)c`` with ``Kᵢⱼ = vᵢᵀCvⱼ``, ``Vᵢⱼ = vᵢᵀvⱼ`` and ``bᵢ = ∇hᵀvᵢ``, whose
minimiser solves a ``k × k`` linear system (Martens and Grosse 2015, section 7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: A second vector whose Gram determinant is below this fraction of the product of the
#: diagonal is (numerically) in the span of the first: it is dropped, not solved for.
COLLINEAR = 1e-10


@dataclass(frozen=True)
class QuadraticStep:
    """The minimiser of the quadratic model in the span of the vectors.

    Attributes:
        coefficients: ``c``, one per vector (``0.0`` for a vector dropped as collinear).
        predicted_change: the undamped model's change at ``c``, ``bᵀc + ½·cᵀKc``
            (``= ½·bᵀc − ½·λ·cᵀVc`` <= 0): what the loss is predicted to do, the denominator of
            the reduction ratio. Martens and Grosse (section 6.5) and kfac-jax leave the
            damping out of it; with it, ``ρ`` is up to twice too large when ``λ`` dominates,
            and the damping falls when it should not.
    """

    coefficients: tuple[float, ...]
    predicted_change: float


def minimise_quadratic_model(
    curvature: Tensor, inner: Tensor, gradient: Tensor, damping: float
) -> QuadraticStep:
    """Coefficients minimising the damped model ``bᵀc + ½·cᵀ(K + λ·V)c`` (float64).

    Args:
        curvature: ``K``, the ``k × k`` Gauss-Newton products ``vᵢᵀCvⱼ`` (positive
            semi-definite).
        inner: ``V``, the ``k × k`` inner products ``vᵢᵀvⱼ``.
        gradient: ``b``, the ``k`` products ``∇hᵀvᵢ``.
        damping: ``λ > 0``.

    A zero vector, or a later vector numerically in the span of the earlier ones, gets
    coefficient 0 (the first step has no previous update; an update parallel to the direction
    adds nothing).

    Raises:
        ValueError: the shapes do not match, or a value is not finite.
    """
    k = gradient.numel()
    if curvature.shape != (k, k) or inner.shape != (k, k):
        raise ValueError(
            f"curvature {tuple(curvature.shape)} and inner {tuple(inner.shape)} must be "
            f"{k} x {k} for {k} gradient products"
        )
    system = (curvature + damping * inner).to(torch.float64)
    rhs = gradient.to(torch.float64)
    if not (torch.isfinite(system).all() and torch.isfinite(rhs).all()):
        raise ValueError("the quadratic model has a non-finite entry")
    kept: list[int] = []
    for index in range(k):
        trial = [*kept, index]
        block = system[trial][:, trial]
        diagonal = float(torch.diagonal(block).prod())
        if diagonal > 0 and float(torch.linalg.det(block)) > COLLINEAR * diagonal:
            kept = trial
    coefficients = [0.0] * k
    if not kept:
        return QuadraticStep(tuple(coefficients), 0.0)
    solution = torch.linalg.solve(system[kept][:, kept], -rhs[kept])
    for index, value in zip(kept, solution.tolist(), strict=True):
        coefficients[index] = float(value)
    undamped = curvature.to(torch.float64)[kept][:, kept]
    change = float(rhs[kept] @ solution + 0.5 * solution @ undamped @ solution)
    return QuadraticStep(tuple(coefficients), change)


def reduction_ratio(loss_before: float, loss_after: float, predicted_change: float) -> float:
    """``ρ = (h(θ + δ) − h(θ)) / M(δ)``: how much of the predicted decrease happened.

    A step the model predicts to change nothing (``M(δ) = 0``) gives ``ρ = 1`` when the loss
    did not rise (nothing to correct), else ``-inf``; a non-finite loss after gives ``-inf``.
    """
    actual = loss_after - loss_before
    if not math.isfinite(actual):
        return -math.inf
    if predicted_change == 0.0:
        return 1.0 if actual <= 0.0 else -math.inf
    return actual / predicted_change


def levenberg_marquardt(
    damping: float, ratio: float, omega: float, low: float, high: float
) -> float:
    """The damping after one adaptation: ``ρ > 3/4`` trusts the model more, ``ρ < 1/4`` less.

    Args:
        damping: ``λ`` now.
        ratio: ``ρ`` of :func:`reduction_ratio`.
        omega: the factor ``ω`` in (0, 1).
        low: smallest ``λ``.
        high: largest ``λ``.
    """
    if ratio > 0.75:
        damping *= omega
    elif ratio < 0.25:
        damping /= omega
    return min(high, max(low, damping))
