"""The plan of SPD-KFAC and PAD-KFAC as data: per factor slot, where it goes and who decomposes.

Pure (no tensors, no process group): every rank computes the same plan, and the dry run
(:mod:`dkfac.strategies.accounting`) reads the same plan the strategies execute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dkfac.comm.cost_model import ClusterCostModel
from dkfac.comm.wire import element_size, packed_values
from dkfac.strategies.decomposition_payload import payload_shapes
from dkfac.strategies.pipeline import FactorSlot
from dkfac.strategies.plan import DecompositionShare, FactorRoute, Placement, gradient_shares
from dkfac.strategies.plan_report import ShareReport
from dkfac.strategies.registry import PADShare, check_share

#: What the decomposers send the other workers: decompositions, or preconditioned gradients.
SharedResult = Literal["decompositions", "gradients"]


def decomposition_bytes(dim: int, method: str, dtype: torch.dtype) -> int:
    """Bytes of one factor's broadcast decomposition: ``(Q, λ)`` or a packed inverse."""
    *tensors, _flag = payload_shapes(method, [("a", dim)])
    return sum(packed_values(shape, symmetric) for shape, symmetric in tensors) * element_size(
        dtype
    )


def gradient_bytes(a_dim: int, g_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one layer's preconditioned ``(d_G, d_A)`` gradient."""
    return a_dim * g_dim * element_size(dtype)


@dataclass(frozen=True)
class ShareChoice:
    """What the decomposers broadcast, and the predicted bytes per step behind the choice.

    Attributes:
        requested: the ``share`` option (``"auto"`` or a mode).
        mode: what is broadcast.
        inv_update_steps: steps between decompositions the choice was made for.
        decomposition_bytes_per_step: every factor's decomposition, once per
            ``inv_update_steps`` steps.
        gradient_bytes_per_step: every layer's preconditioned gradient, every step.
    """

    requested: PADShare
    mode: SharedResult
    inv_update_steps: int
    decomposition_bytes_per_step: float
    gradient_bytes_per_step: int

    def report(self) -> ShareReport:
        """As ``pre.plan()["share"]``."""
        return {
            "requested": self.requested,
            "mode": self.mode,
            "inv_update_steps": self.inv_update_steps,
            "decomposition_bytes_per_step": self.decomposition_bytes_per_step,
            "gradient_bytes_per_step": self.gradient_bytes_per_step,
        }


def choose_share(
    requested: PADShare,
    dims: Sequence[tuple[int, int]],
    *,
    inverse_method: str,
    inv_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    inv_update_steps: int,
) -> ShareChoice:
    """``requested``, or for ``"auto"`` the mode with fewer predicted bytes per step.

    Decompositions travel once per decomposition step, preconditioned gradients every step:
    ``Σ decomposition_bytes / inv_update_steps`` against ``Σ d_A·d_G·element``. A tie keeps
    the decompositions. Pure: every rank decides the same from the same dims, schedule and
    dtypes (the world size does not enter: both are broadcasts to every worker).

    Args:
        requested: ``"decompositions"``, ``"gradients"`` or ``"auto"``.
        dims: ``(d_A, d_G)`` of each layer.
        inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"`` (what a decomposition holds).
        inv_dtype: dtype decompositions travel in.
        grad_dtype: dtype preconditioned gradients travel in.
        inv_update_steps: steps between decompositions (the schedule's value at the start).

    Raises:
        ValueError: an unknown ``requested`` or an ``inv_update_steps`` below 1.
    """
    check_share(requested)
    steps = inv_update_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"inv_update_steps={steps!r} is not allowed: expected an integer >= 1")
    decompositions = sum(
        decomposition_bytes(dim, inverse_method, inv_dtype) for pair in dims for dim in pair
    )
    gradients = sum(gradient_bytes(a_dim, g_dim, grad_dtype) for a_dim, g_dim in dims)
    per_step = decompositions / inv_update_steps
    mode: SharedResult
    if requested == "auto":
        mode = "gradients" if gradients < per_step else "decompositions"
    else:
        mode = requested
    return ShareChoice(requested, mode, inv_update_steps, per_step, gradients)


def destination_boundaries(destination: Sequence[int | None], order: Sequence[int]) -> list[int]:
    """Positions in ``order`` where the destination changes (a bucket must start there)."""
    return [p for p in range(1, len(order)) if destination[order[p]] != destination[order[p - 1]]]


@dataclass(frozen=True)
class SlotCosts:
    """What the placement of factor slots is planned from (pure data, the same on every rank).

    Attributes:
        slots: the factors in ready order.
        wire: packed bytes of each factor on the wire.
        decomposition_s: predicted decomposition time of each factor.
        cost: the cluster's cost model.
        inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        inv_dtype: dtype of the decompositions.
        world_size: number of workers.
        size_based: the cost model could not be trusted (:meth:`ClusterCostModel.problems`):
            ``decomposition_s`` is ``d³`` and placements go by size alone.
        share: what the decomposers broadcast (:class:`ShareChoice`).
        gradient_wire: bytes of each layer's preconditioned gradient, in layer order.
    """

    slots: list[FactorSlot]
    wire: list[int]
    decomposition_s: list[float]
    cost: ClusterCostModel
    inverse_method: str
    inv_dtype: torch.dtype
    world_size: int
    size_based: bool = False
    share: SharedResult = "decompositions"
    gradient_wire: tuple[int, ...] = ()


@dataclass(frozen=True)
class FactorPlacement:
    """A pipelined strategy's plan: per slot its destination and decomposer; size buckets.

    ``share`` is PAD's choice of what the decomposers broadcast and why (``costs.share`` is
    its mode); ``None``: decompositions, chosen by no one (SPD).
    """

    costs: SlotCosts
    destination: list[int | None]
    decomposer: list[int]
    buckets: list[list[int]]
    share: ShareChoice | None = None

    def placement(self) -> Placement:
        """As the runner executes it: factors in ready order, exchanged from the hooks.

        Sharing decompositions, each decomposing rank broadcasts its factors to every worker
        in one fused share (sources ascending), each factor with its own validity flag.
        Sharing gradients, a layer's two factors have one decomposer, which preconditions the
        layer; each such rank broadcasts its layers' preconditioned gradients to every worker
        in one fused share (sources ascending).
        """
        routes = tuple(
            FactorRoute(slot.layer, slot.side, slot.dim, destination, decomposer)
            for slot, destination, decomposer in zip(
                self.costs.slots, self.destination, self.decomposer, strict=True
            )
        )
        world = tuple(range(self.costs.world_size))
        buckets = tuple(tuple(bucket) for bucket in self.buckets)
        if self.costs.share == "gradients":
            owner = {route.layer: route.decomposed_by for route in routes if route.side == "a"}
            sources = [owner[layer] for layer in range(len(owner))]
            shared = gradient_shares(sources, world)
            return Placement(
                self.costs.world_size, "hooks", routes, gradients=shared, buckets=buckets
            )
        shares = []
        for source in world if len(world) > 1 else ():
            units = tuple((route.key,) for route in routes if route.decomposed_by == source)
            if units:
                shares.append(DecompositionShare(source, units, world))
        return Placement(self.costs.world_size, "hooks", routes, tuple(shares), buckets=buckets)
