"""Whether tensors are entirely finite, decided on the device with one reading pass each.

``torch.isfinite(t).all()`` takes four passes over ``t`` on the CPU (``abs``, two comparisons,
the reduction), none of them vectorised: on a 1001x1001 factor 2.3 ms against 0.1 ms for its
extremes. Every check of factors, decompositions and gradients goes through here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """Device booleans, one per tensor (all on one device): is every entry finite?

    One reading pass per tensor: its extremes are finite exactly when all its entries are
    (minimum and maximum propagate NaN). On an accelerator the passes share one launch (the
    infinity norm of every tensor); on the CPU, where a launch costs little, each tensor takes
    ``aminmax``, which is vectorised where PyTorch's CPU infinity norm is not (about 20 times
    faster on a small CNN's factors, where it was a tenth of the K-FAC step), and the extremes
    of all tensors are checked together (a few operations, not a few per tensor).
    """
    # An empty tensor is finite; neither reduction has an identity to give it, so it is
    # checked as one zero.
    checked = [tensor if tensor.numel() else tensor.new_zeros(1) for tensor in tensors]
    if checked and checked[0].device.type != "cpu":
        peaks = torch._foreach_norm(checked, float("inf"))
        return torch.isfinite(torch.stack(list(peaks)))  # promoted, so each peak stays exact
    if not checked:
        return torch.ones(0, dtype=torch.bool)
    pairs = [torch.aminmax(tensor) for tensor in checked]
    # Stacked in their promoted dtype (exact: every float widens to it, NaN and Inf kept).
    lows, highs = torch.stack([p.min for p in pairs]), torch.stack([p.max for p in pairs])
    return torch.isfinite(torch.stack([lows, highs])).all(dim=0)


def all_finite(tensor: Tensor) -> Tensor:
    """Device boolean: whether every entry of ``tensor`` is finite (one reading pass)."""
    if tensor.device.type != "cpu" and tensor.numel():
        return torch.isfinite(torch.linalg.vector_norm(tensor, float("inf")))
    return finite_flags([tensor])[0]
