"""What a ``torch.amp.GradScaler`` means for K-FAC, through its public methods only.

``G`` must be computed from unscaled output gradients, and a step whose gradients are not
finite (the scaler skips the optimizer step) must change no factor and no decomposition.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from dkfac.curvature.finite import finite_flags


def autocast_disabled(device_type: str) -> contextlib.AbstractContextManager[object]:
    """A context that turns ``torch.autocast`` off for ``device_type``; none where it is off.

    Entering ``torch.autocast(..., enabled=False)`` costs tens of microseconds of host time,
    a tenth of a plain ``step()``'s (docs/benchmarks.md), and changes nothing outside
    autocast. Where torch cannot say (before 2.4, or a device type it does not know), the
    context is entered.
    """
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # torch < 2.4 takes no device; an unknown device type
        enabled = True
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def loss_scale(grad_scaler: Any | None) -> float | None:
    """The scaler's current loss scale (one host read), or None without an enabled scaler.

    Args:
        grad_scaler: a ``torch.amp.GradScaler`` or None.
    """
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    return float(grad_scaler.get_scale())


def gradients_finite(model: nn.Module, grad_scaler: Any | None) -> bool:
    """Whether every gradient of ``model`` is finite (checked only with an enabled scaler).

    One host read per call. Gradients are read after averaging (DDP, DeAR), so every worker
    decides alike.

    Args:
        model: the model whose ``.grad`` tensors are checked.
        grad_scaler: a ``torch.amp.GradScaler`` or None (then nothing is checked).
    """
    if grad_scaler is None or not grad_scaler.is_enabled():
        return True
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for parameter in model.parameters():
        if parameter.grad is not None:
            by_device.setdefault(parameter.grad.device, []).append(parameter.grad)
    if not by_device:
        return True
    # One check per device (one launch on an accelerator), one host read for all.
    flags = [finite_flags(grads).all() for grads in by_device.values()]
    return bool(torch.stack([flag.to(flags[0].device) for flag in flags]).all())
