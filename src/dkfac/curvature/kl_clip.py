"""KL clipping: one scale for every preconditioned gradient, bounding the step's KL change."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def kl_clip_scale(
    directions: Sequence[Tensor], grads: Sequence[Tensor], lr: float, kl_clip: float
) -> Tensor:
    """ν = min(1, sqrt(κ / (η² Σ⟨V, ∇⟩))) as a device scalar: no host synchronisation.

    Args:
        directions: the preconditioned gradients ``V`` of the layers.
        grads: the layers' gradients ``∇``, same shapes.
        lr: the learning rate η of the step.
        kl_clip: κ.

    Returns:
        ν in the gradients' dtype, on their device. The inner products are summed in float64.
    """
    device = grads[0].device
    products = torch._foreach_mul(list(directions), list(grads))  # shared launches
    by_device: dict[torch.device, list[Tensor]] = {}
    for product in products:
        by_device.setdefault(product.device, []).append(product.reshape(-1))
    terms = []
    for where, flat in by_device.items():
        if where.type == "cpu":  # a launch costs little: one sum each, no copy
            terms += [part.sum(dtype=torch.float64).to(device) for part in flat]
        else:  # one copy of the products (fast memory) instead of a launch per layer
            terms.append(torch.cat(flat).sum(dtype=torch.float64).to(device))
    vg = torch.stack(terms).sum() * (lr * lr)
    nu = torch.sqrt(kl_clip / vg.clamp_min(0.0)).clamp(max=1.0)
    return nu.to(grads[0].dtype)
