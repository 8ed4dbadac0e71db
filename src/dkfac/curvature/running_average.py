"""Running averages of Kronecker factors, decided on the device.

A worker folds each batch factor into its running average ``ε·running + (1−ε)·batch``; a batch
with a NaN or Inf is left out and a running average that is not finite yet counts as "no
estimate", all without reading anything back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.curvature.finite import all_finite, finite_flags


def running_average(
    running: Tensor | None, batch: Tensor, decay: float, batch_ok: Tensor | None = None
) -> Tensor:
    """``ε·running + (1−ε)·batch``; the first estimate is the batch itself.

    A batch estimate with a NaN or Inf is not folded in (the running average keeps its value),
    and a running average that is not finite yet counts as "no estimate": this is decided on the
    device, with no host synchronisation. The average is ``lerp(running, batch, 1−ε)`` (one
    pass; :func:`running_averages` folds many factors the same way, bit for bit).
    ``batch_ok``: :func:`all_finite` of ``batch`` when the caller has it already.
    """
    batch_ok = all_finite(batch) if batch_ok is None else batch_ok
    if running is None:
        return torch.where(batch_ok, batch, torch.full_like(batch, float("nan")))
    wide = torch.promote_types(running.dtype, batch.dtype)  # as ε·running + (1−ε)·batch did
    updated = torch.lerp(running.to(wide), batch.to(wide), 1.0 - decay)
    running_ok = all_finite(running)
    return torch.where(batch_ok, torch.where(running_ok, updated, batch), running)


def running_averages(
    runnings: Sequence[Tensor],
    batches: Sequence[Tensor],
    decay: float,
    present: Tensor | None = None,
) -> tuple[list[Tensor], Tensor]:
    """:func:`running_average` of many running factors at once (each must exist).

    The factor updates of a model are many matrices with a few elementwise passes each; here
    they share their launches (finiteness of all batches and averages, the blend of all) and
    each factor adds only its choice between blend, batch and old value, so a step that
    updates factors costs the device little and the host a few operations per factor.

    Args:
        runnings: the running factors.
        batches: the batch factors, one per running factor (same shape and dtype: mixed
            pairs go through :func:`running_average`, which promotes).
        decay: ``ε``.
        present: device booleans, one per factor: whether it has a batch at all (a factor
            without one keeps its value, decided on the device); None: all have one.

    Returns:
        The new running factors and the device booleans "batch ``i`` was finite".
    """
    batch_ok = finite_flags(batches)
    usable = batch_ok if present is None else batch_ok & present
    running_ok = finite_flags(runnings)
    both = usable & running_ok
    result = list(torch._foreach_lerp(list(runnings), list(batches), 1.0 - decay))
    for i, (blend, batch, running) in enumerate(zip(result, batches, runnings, strict=True)):
        fallback = torch.where(usable[i], batch, running)
        if blend.is_contiguous():
            # Into the blend's own fresh buffer, flat: the CPU's where with a 0-dim condition
            # is slower on shaped tensors and into new memory (page faults), 15-25% here.
            flat = blend.view(-1)
            torch.where(both[i], flat, fallback.reshape(-1), out=flat)
        else:
            result[i] = torch.where(both[i], blend, fallback)
    return result, batch_ok
