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
    terms = [
        (v * g).sum(dtype=torch.float64).to(device) for v, g in zip(directions, grads, strict=True)
    ]
    vg = torch.stack(terms).sum() * (lr * lr)
    nu = torch.sqrt(kl_clip / vg.clamp_min(0.0)).clamp(max=1.0)
    return nu.to(grads[0].dtype)
