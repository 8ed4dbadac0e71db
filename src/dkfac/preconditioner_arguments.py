"""Arguments of :class:`dkfac.KFACPreconditioner` that exclude each other, refused early."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from dkfac.strategies import Strategy


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


def refuse_compiled_subset(compiled: bool, statistics_fraction: object) -> None:
    """Refuse factors from part of each batch for a model run under ``torch.compile``.

    The compiled hooks add every call's whole statistic inside the graph
    (:mod:`dkfac.deferred_statistics`); a part of it is not implemented there.

    Raises:
        ValueError: naming the argument.
    """
    if compiled and statistics_fraction != 1.0:
        raise ValueError(
            f"statistics_fraction={statistics_fraction!r} is not allowed with a compiled model: "
            "its statistics are gathered inside the compiled graph, from whole batches only "
            "(use 1.0, or build the preconditioner for the eager model)"
        )


def refuse_unagreed_adaptive(adaptive: Any | None, strategy: Strategy) -> None:
    """Refuse adaptive K-FAC on several processes with a strategy that does not communicate.

    Each process would choose its own step and damping. ``strategy`` is closed first (it may
    have made a process group).

    Raises:
        ValueError: naming the strategy and the number of processes.
    """
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if adaptive is not None and strategy.comm is None and processes > 1:
        strategy.close()
        raise ValueError(
            f"adaptive is not allowed with strategy={strategy.name!r} on {processes} processes: "
            "each would choose its own step and damping; use a distributed strategy (e.g. "
            "'dkfac'), which agrees them"
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


def refuse_step_call(
    adaptive: bool, inputs: Any, targets: Any, removed: bool, by_hand_when_hooked: bool
) -> None:
    """Raise if ``step(inputs, targets)`` cannot run as called.

    Raises:
        ValueError: the batch given without adaptive K-FAC, or missing (or half) with it.
        RuntimeError: after ``remove()``, or by hand on a preconditioner attached to an
            optimizer (whose ``step()`` runs it).
    """
    if (inputs is None) == adaptive or (targets is None) != (inputs is None):
        raise ValueError(
            "step(inputs, targets) needs both with adaptive K-FAC, and neither without it "
            f"(adaptive={adaptive}, inputs given: {inputs is not None}, targets given: "
            f"{targets is not None})"
        )
    if removed:
        raise RuntimeError(
            "step() after remove(): this preconditioner has detached its "
            "hooks; build a new KFACPreconditioner"
        )
    if by_hand_when_hooked:
        raise RuntimeError(
            "step() by hand on a preconditioner attached to an optimizer: "
            "optimizer.step() runs it (calling both would precondition twice)"
        )
