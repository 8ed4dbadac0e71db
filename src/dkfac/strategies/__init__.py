"""Where each K-FAC phase runs: one module per strategy, the planners, the dry-run accounting.

:func:`make_strategy` maps a ``strategy=`` name to its implementation.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from dkfac.comm.communicator import Communicator, require_distributed
from dkfac.comm.cost_model import ClusterCostModel, CostModelCache
from dkfac.comm.recorder import StepRecorder
from dkfac.strategies.base import Strategy
from dkfac.strategies.d_kfac import DKFACStrategy
from dkfac.strategies.dp import DPStrategy
from dkfac.strategies.kaisa import KAISAStrategy
from dkfac.strategies.local import LocalStrategy
from dkfac.strategies.pad import PADStrategy
from dkfac.strategies.spd import SPDStrategy

STRATEGY_NAMES: tuple[str, ...] = ("local", "dkfac", "kaisa", "spd", "pad", "dp")


def make_strategy(
    name: str,
    recorder: StepRecorder,
    *,
    grad_worker_fraction: float = 1.0,
    bucket_cap_mb: float = 25.0,
    comm_dtype: torch.dtype | None = None,
    inverse_method: str = "eigen",
    inv_dtype: torch.dtype = torch.float32,
    cost_model: ClusterCostModel | CostModelCache | None = None,
    profile_steps: int = 5,
) -> Strategy:
    """The strategy called ``name``, with its communicator when it needs one.

    SPD and PAD launch collectives from autograd hooks, while DDP may be allreducing
    gradients on the default group: they get a process group of their own so the two
    streams of collectives can never interleave differently on different ranks
    (:meth:`Communicator.with_own_group`; the strategy's ``close()`` destroys it).
    ``cost_model`` (SPD/PAD only) is a measured :class:`ClusterCostModel`, a
    :class:`CostModelCache` that measures on first use and serves every later strategy, or
    ``None`` to measure for this strategy alone.

    Raises:
        ValueError: unknown name, or a fraction the world size does not allow.
        RuntimeError: a distributed strategy without an initialised process group.
    """
    if name == LocalStrategy.name:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            warnings.warn(
                "strategy='local' in a process group of several workers: each worker "
                "preconditions with factors of its own shard, so DDP replicas drift apart; "
                "use strategy='dkfac' or 'kaisa'",
                RuntimeWarning,
                stacklevel=3,
            )
        return LocalStrategy(recorder)
    if name not in STRATEGY_NAMES:
        raise ValueError(
            f"strategy={name!r} is not allowed: expected one of "
            f"{', '.join(map(repr, STRATEGY_NAMES))}"
        )
    require_distributed(f"strategy={name!r}")
    if name in (SPDStrategy.name, PADStrategy.name):
        comm = Communicator.with_own_group(
            recorder, bucket_cap_mb=bucket_cap_mb, comm_dtype=comm_dtype
        )
        pipelined = SPDStrategy if name == SPDStrategy.name else PADStrategy
        return pipelined(
            comm,
            recorder,
            inverse_method=inverse_method,
            inv_dtype=inv_dtype,
            cost_model=cost_model,
            profile_steps=profile_steps,
        )
    comm = Communicator(recorder, bucket_cap_mb=bucket_cap_mb, comm_dtype=comm_dtype)
    if name == DKFACStrategy.name:
        return DKFACStrategy(comm, recorder)
    if name == DPStrategy.name:
        return DPStrategy(comm, recorder)
    return KAISAStrategy(comm, recorder, grad_worker_fraction)


__all__ = [
    "STRATEGY_NAMES",
    "DKFACStrategy",
    "DPStrategy",
    "KAISAStrategy",
    "LocalStrategy",
    "PADStrategy",
    "SPDStrategy",
    "Strategy",
    "make_strategy",
]
