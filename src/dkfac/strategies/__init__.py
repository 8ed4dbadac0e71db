"""Where each K-FAC phase runs: one module per strategy, the planners, the dry-run accounting.

:func:`make_strategy` maps a ``strategy=`` name to its implementation.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from dkfac.comm.communicator import Communicator
from dkfac.comm.groups import require_distributed
from dkfac.comm.recorder import StepRecorder
from dkfac.strategies.base import Strategy
from dkfac.strategies.d_kfac import DKFACStrategy
from dkfac.strategies.dp import DPStrategy
from dkfac.strategies.kaisa import KAISAStrategy
from dkfac.strategies.local import LocalStrategy
from dkfac.strategies.pad import PADStrategy
from dkfac.strategies.registry import (
    STRATEGIES,
    DKFACOptions,
    DPOptions,
    KAISAOptions,
    LocalOptions,
    PADOptions,
    PipelinedOptions,
    SPDOptions,
    StrategyOptions,
    StrategySpec,
    option_keywords,
    resolve_options,
    strategy_names,
)
from dkfac.strategies.spd import SPDStrategy


def make_strategy(
    options: StrategyOptions,
    recorder: StepRecorder,
    *,
    bucket_cap_mb: float = 25.0,
    comm_dtype: torch.dtype | None = None,
    inverse_method: str = "eigen",
    inv_dtype: torch.dtype = torch.float32,
    factor_dtype: torch.dtype = torch.float32,
    inv_update_steps: int = 1,
) -> Strategy:
    """The strategy ``options`` select, with its communicator when it needs one.

    ``inv_update_steps`` is the steps between decompositions at the start of the run (PAD's
    ``share="auto"`` decides for it).

    SPD and PAD launch collectives from autograd hooks, while DDP may be allreducing
    gradients on the default group: they get a process group of their own so the two
    streams of collectives can never interleave differently on different ranks
    (:meth:`Communicator.with_own_group`; the strategy's ``close()`` destroys it).

    Raises:
        ValueError: options the world size does not allow.
        RuntimeError: a distributed strategy without an initialised process group.
    """
    if isinstance(options, LocalOptions):
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            warnings.warn(
                "strategy='local' in a process group of several workers: each worker "
                "preconditions with factors of its own shard, so DDP replicas drift apart; "
                "use strategy='dkfac' or 'kaisa'",
                RuntimeWarning,
                stacklevel=3,
            )
        return LocalStrategy(recorder)
    require_distributed(f"strategy={options.name!r}")
    if isinstance(options, PipelinedOptions):
        comm = Communicator.with_own_group(
            recorder, bucket_cap_mb=bucket_cap_mb, comm_dtype=comm_dtype
        )
    else:
        comm = Communicator(recorder, bucket_cap_mb=bucket_cap_mb, comm_dtype=comm_dtype)
    return distributed_strategy(
        options,
        comm,
        recorder,
        inverse_method=inverse_method,
        inv_dtype=inv_dtype,
        factor_dtype=factor_dtype,
        inv_update_steps=inv_update_steps,
    )


def distributed_strategy(
    options: StrategyOptions,
    comm: Communicator,
    recorder: StepRecorder,
    *,
    inverse_method: str = "eigen",
    inv_dtype: torch.dtype = torch.float32,
    factor_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype | None = None,
    inv_update_steps: int = 1,
) -> Strategy:
    """The distributed strategy ``options`` select, on ``comm`` (real or recording).

    The one place that maps options to a strategy class: :func:`make_strategy` and the dry
    run (:mod:`dkfac.strategies.accounting`) both build strategies here. ``grad_dtype``
    (``None``: the layers') and ``inv_update_steps`` are what PAD's ``share="auto"`` decides
    with.

    Raises:
        ValueError: options of no distributed strategy, or the world size does not allow them.
    """
    if isinstance(options, PipelinedOptions):
        common: dict[str, Any] = {
            "inverse_method": inverse_method,
            "inv_dtype": inv_dtype,
            "factor_dtype": factor_dtype,
            "grad_dtype": grad_dtype,
            "cost_model": options.cost_model,
            "profile_steps": options.profile_steps,
        }
        if isinstance(options, PADOptions):
            return PADStrategy(
                comm, recorder, share=options.share, inv_update_steps=inv_update_steps, **common
            )
        return SPDStrategy(comm, recorder, **common)
    if isinstance(options, KAISAOptions):
        return KAISAStrategy(comm, recorder, options)
    if isinstance(options, DPOptions):
        return DPStrategy(comm, recorder)
    if isinstance(options, DKFACOptions):
        return DKFACStrategy(comm, recorder)
    raise ValueError(f"strategy={options.name!r} is not a distributed strategy")


__all__ = [
    "STRATEGIES",
    "DKFACOptions",
    "DKFACStrategy",
    "DPOptions",
    "DPStrategy",
    "KAISAOptions",
    "KAISAStrategy",
    "LocalOptions",
    "LocalStrategy",
    "PADOptions",
    "PADStrategy",
    "SPDOptions",
    "SPDStrategy",
    "Strategy",
    "StrategyOptions",
    "StrategySpec",
    "distributed_strategy",
    "make_strategy",
    "option_keywords",
    "resolve_options",
    "strategy_names",
]
