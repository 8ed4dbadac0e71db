"""Checks of :class:`~dkfac.dear.averaging.DeAR`'s constructor arguments.

Each check raises ``ValueError`` with a message that names the argument, before DeAR touches
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from dkfac.dear.bucket_search import power_of_two_sizes

#: What DeAR accepts instead of an optimizer: ``params -> Optimizer``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def check_model(model: nn.Module) -> None:
    """Check that ``model`` is a module DeAR can hook: not wrapped in DDP.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``, or is a ``DistributedDataParallel``.
    """
    if not isinstance(model, nn.Module) or isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"model={type(model).__name__} is not allowed: expected a torch.nn.Module "
            "that is not wrapped in DistributedDataParallel (DeAR replaces DDP)"
        )


def check_bucket_options(
    bucket_cap_mb: float | str, auto_range_mb: tuple[float, float], auto_trial_steps: int
) -> bool:
    """Check the bucket options; True when the size is searched online.

    Raises:
        ValueError: ``bucket_cap_mb`` is neither a positive number of MiB nor ``"auto"``, or,
            with ``"auto"``, ``auto_range_mb`` or ``auto_trial_steps`` is not allowed.
    """
    if isinstance(bucket_cap_mb, str):
        if bucket_cap_mb != "auto":
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb!r} is not allowed: expected a positive "
                "number of MiB or 'auto'"
            )
        if len(auto_range_mb) != 2:
            raise ValueError(
                f"auto_range_mb={auto_range_mb!r} is not allowed: expected (low, high) MiB"
            )
        power_of_two_sizes(*auto_range_mb)
        if (
            isinstance(auto_trial_steps, bool)
            or not isinstance(auto_trial_steps, int)
            or (auto_trial_steps < 1)
        ):
            raise ValueError(
                f"auto_trial_steps={auto_trial_steps!r} is not allowed: expected an int >= 1"
            )
        return True
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not 0 < bucket_cap_mb < float("inf")
    ):
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb!r} is not allowed: expected a positive number "
            "of MiB or 'auto'"
        )
    return False


def make_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory
) -> torch.optim.Optimizer:
    """The optimizer itself, or the factory's over ``model.parameters()``; model's tensors only.

    Raises:
        ValueError: ``optimizer`` is neither an optimizer nor a factory returning one, or it
            updates a tensor that is not a parameter of ``model``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ValueError(
                f"optimizer={optimizer!r} is not allowed: expected a torch.optim.Optimizer "
                "or a callable params -> Optimizer"
            )
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer factory returned {type(optimizer).__name__}: expected a "
                "torch.optim.Optimizer"
            )
    owned = {id(p) for p in model.parameters()}
    foreign = [
        tuple(p.shape)
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) not in owned
    ]
    if foreign:
        raise ValueError(
            f"optimizer is not allowed: it updates {len(foreign)} tensor(s) that are not "
            f"parameters of the model (shapes {foreign[:3]}); DeAR applies updates from "
            "the model's hooks, so every optimized tensor must be a model parameter"
        )
    return optimizer
