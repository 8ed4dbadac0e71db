"""Factored Tikhonov damping: each factor's shift from both factors' traces.

``(A + √γ·π I)`` and ``(G + √γ/π I)`` with ``π = sqrt((tr A / d_A) / (tr G / d_G))`` (Martens &
Grosse 2015 §6.3): the shifts of the methods that fix the damping when they decompose
(``"inverse"``, ``"cholesky"``; :mod:`dkfac.curvature.inverse`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.curvature.factor_side import FACTOR_SIDES
from dkfac.curvature.staging import host_floats


def tikhonov_shift(side: str, mean_a: Tensor, mean_g: Tensor, damping: float) -> Tensor:
    """The shift of factor ``side`` from :func:`tikhonov_shifts`."""
    return tikhonov_shifts(mean_a, mean_g, damping)[FACTOR_SIDES.index(side)]


def tikhonov_shifts(mean_a: Tensor, mean_g: Tensor, damping: float) -> tuple[Tensor, Tensor]:
    """Shifts ``√γ·π`` (for A) and ``√γ/π`` (for G), ``π = sqrt(mean_a / mean_g)``.

    ``mean_a``, ``mean_g`` are ``tr(F)/d`` of the factors (see :func:`trace_mean`); ``π = 1``
    when either is not positive.
    """
    valid = (mean_a > 0) & (mean_g > 0)
    pi = torch.sqrt(torch.where(valid, mean_a / torch.where(valid, mean_g, 1.0), 1.0))
    root = math.sqrt(damping)
    return root * pi, root / pi


def shift_table(means: Tensor, damping: float) -> Tensor:
    """The ``(L, 2)`` shifts (``A``, ``G``) of :func:`tikhonov_shifts` for ``(L, 2)`` trace means.

    Every layer's in a few launches, equal entry for entry to each layer's own
    :func:`tikhonov_shift` (the same elementwise operations).
    """
    return torch.stack(tikhonov_shifts(means[:, 0], means[:, 1], damping), dim=1)


def trace_mean(matrix: Tensor, dtype: torch.dtype) -> Tensor:
    """``tr(F) / d`` of a factor in ``dtype`` (the input of ``π``); a vector is a diagonal."""
    return trace_means([matrix], dtype)[0]


def trace_means(factors: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """:func:`trace_mean` of each factor (all on one device), one vector in ``dtype``.

    One sum per factor, of its diagonal converted to ``dtype`` (not the whole matrix); the
    divisions are one operation for all, by the dimensions as a device tensor (a GPU would
    multiply by a Python divisor's rounded reciprocal): one value, whichever way it is asked.
    """
    if not factors:
        return torch.zeros(0, dtype=dtype)
    sums = [(f if f.dim() == 1 else torch.diagonal(f)).to(dtype).sum() for f in factors]
    wide = torch.promote_types(dtype, torch.float32)  # a 16-bit dim would round (1025: 1024)
    dims = host_floats([f.shape[0] for f in factors], sums[0].device).to(wide)
    return (torch.stack(sums).to(wide) / dims).to(dtype)
