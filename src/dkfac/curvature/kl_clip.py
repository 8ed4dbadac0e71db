"""KL clipping: one scale for every preconditioned gradient, bounding the step's KL change."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.curvature.chunks import cut_by_size

#: Entries of the products ``V ⊙ ∇`` one shared launch forms at most (on an accelerator): the
#: products and their concatenation are held at once, twice this many entries.
_CHUNK = 1 << 24

_DEVICE = operator.attrgetter("device")


def _chunks(pairs: list[tuple[Tensor, Tensor]]) -> list[list[tuple[Tensor, Tensor]]]:
    """``pairs`` in order, cut where the entries would pass :data:`_CHUNK` (one device each)."""

    def one_device(first: tuple[Tensor, Tensor], pair: tuple[Tensor, Tensor]) -> bool:
        return first[0].device == pair[0].device

    directions = [v for v, _ in pairs]
    if sum(map(Tensor.numel, directions)) <= _CHUNK and len(set(map(_DEVICE, directions))) == 1:
        return [pairs]  # the common case, without a Python call per layer
    return cut_by_size(pairs, lambda pair: pair[0].numel(), _CHUNK, one_device)


def kl_clip_scale(
    directions: Sequence[Tensor],
    grads: Sequence[Tensor],
    lr: float,
    kl_clip: float,
    shared_launches: bool | None = None,
) -> Tensor:
    """ν = min(1, sqrt(κ / (η² Σ⟨V, ∇⟩))) as a device scalar: no host synchronisation.

    Args:
        directions: the preconditioned gradients ``V`` of the layers.
        grads: the layers' gradients ``∇``, same shapes.
        lr: the learning rate η of the step.
        kl_clip: κ.
        shared_launches: see :func:`kl_inner_product`.

    Returns:
        ν in the gradients' dtype, on their device. The inner products are summed in float64.
    """
    vg = kl_inner_product(directions, grads, shared_launches)
    return kl_scale(vg, lr * lr, kl_clip, grads[0].dtype)


def kl_inner_product(
    directions: Sequence[Tensor], grads: Sequence[Tensor], shared_launches: bool | None = None
) -> Tensor:
    """``Σ⟨V, ∇⟩`` over the layers, summed in float64, as a device scalar.

    Args:
        directions: the preconditioned gradients ``V`` of the layers.
        grads: the layers' gradients ``∇``, same shapes.
        shared_launches: the products formed in ``_foreach`` launches and summed in chunks
            (``None``: off the CPU, where each launch is a cost of its own).
    """
    device = grads[0].device
    pairs = list(zip(directions, grads, strict=True))
    if shared_launches is None:
        shared_launches = device.type != "cpu"
    if not shared_launches:  # a CPU launch costs little: one product and one sum per layer
        terms = [(v * g).sum(dtype=torch.float64).to(device) for v, g in pairs]
    else:  # shared launches, in chunks: at most _CHUNK products held at a time
        terms = []
        for chunk in _chunks(pairs):
            products = torch._foreach_mul([v for v, _ in chunk], [g for _, g in chunk])
            flat = torch._C._nn.flatten_dense_tensors(list(products))  # cat of views, in C++
            terms.append(flat.sum(dtype=torch.float64).to(device))
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


def kl_scale(
    inner_product: Tensor, lr_squared: float | Tensor, kl_clip: float | Tensor, dtype: torch.dtype
) -> Tensor:
    """ν = min(1, sqrt(κ / (η² · inner_product))) in ``dtype``, on the product's device.

    ``lr_squared`` and ``kl_clip`` are numbers or float64 device scalars (read where the
    operations run, as a replayed CUDA graph needs): the same operations either way, so the
    same bits.
    """
    vg = inner_product * lr_squared
    nu = torch.sqrt(vg.clamp_min(0.0).reciprocal() * kl_clip).clamp(max=1.0)
    return nu.to(dtype)
