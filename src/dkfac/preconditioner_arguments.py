"""Arguments of :class:`dkfac.KFACPreconditioner` that exclude each other, refused early."""

from __future__ import annotations

from typing import Any

from torch import nn


def refuse_conflicting_arguments(
    model: Any, adaptive: Any | None, grad_scaler: Any | None, optimizer: Any | None
) -> None:
    """Refuse a model that is not a module and the combinations K-FAC cannot honour.

    Raises:
        ValueError: naming the argument and why.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
    if adaptive is not None and grad_scaler is not None:
        raise ValueError(
            "grad_scaler is not allowed with adaptive: the quadratic model is measured in "
            "the model's own precision (train adaptive K-FAC without loss scaling)"
        )
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise ValueError(
            f"grad_scaler={grad_scaler!r} is not allowed: expected a torch.amp.GradScaler or None"
        )
    if optimizer is not None and adaptive is not None:
        raise ValueError(
            "optimizer is not allowed with adaptive: adaptive K-FAC's step needs the batch "
            "(call pre.step(inputs, targets) before optimizer.step())"
        )


def check_blocks(blocks: Any | None) -> None:
    """Refuse a ``blocks=`` mapping that is not module types to callables.

    Raises:
        ValueError: naming the offending entry.
    """
    if blocks is None:
        return
    if not hasattr(blocks, "items"):
        raise ValueError(f"blocks={blocks!r} is not allowed: expected a mapping type -> factory")
    for kind, factory in blocks.items():
        if not (isinstance(kind, type) and issubclass(kind, nn.Module)) or not callable(factory):
            raise ValueError(
                f"blocks entry {kind!r}: {factory!r} is not allowed: expected an nn.Module "
                "subclass mapped to a callable that returns its dkfac.curvature.KroneckerBlock"
            )
