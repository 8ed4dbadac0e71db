"""The plan of SPD-KFAC and PAD-KFAC as data: per factor slot, where it goes and who decomposes.

Pure (no tensors, no process group): every rank computes the same plan, and the dry run
(:mod:`dkfac.strategies.accounting`) reads the same plan the strategies execute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dkfac.comm.cost_model import ClusterCostModel
from dkfac.comm.wire import element_size, packed_values
from dkfac.strategies.decomposition_payload import payload_shapes
from dkfac.strategies.pipeline import FactorSlot
from dkfac.strategies.plan import DecompositionShare, FactorRoute, Placement


def decomposition_bytes(dim: int, method: str, dtype: torch.dtype) -> int:
    """Bytes of one factor's broadcast decomposition: ``(Q, λ)`` or a packed inverse."""
    *tensors, _flag = payload_shapes(method, [("a", dim)])
    return sum(packed_values(shape, symmetric) for shape, symmetric in tensors) * element_size(
        dtype
    )


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
        inverse_method: ``"eigen"`` or ``"inverse"``.
        inv_dtype: dtype of the decompositions.
        world_size: number of workers.
        size_based: the cost model could not be trusted (:meth:`ClusterCostModel.problems`):
            ``decomposition_s`` is ``d³`` and placements go by size alone.
    """

    slots: list[FactorSlot]
    wire: list[int]
    decomposition_s: list[float]
    cost: ClusterCostModel
    inverse_method: str
    inv_dtype: torch.dtype
    world_size: int
    size_based: bool = False


@dataclass(frozen=True)
class FactorPlacement:
    """A pipelined strategy's plan: per slot its destination and decomposer; size buckets."""

    costs: SlotCosts
    destination: list[int | None]
    decomposer: list[int]
    buckets: list[list[int]]

    def placement(self) -> Placement:
        """As the runner executes it: factors in ready order, exchanged from the hooks.

        Each decomposing rank broadcasts its factors to every worker in one fused share
        (sources ascending), each factor with its own validity flag.
        """
        routes = tuple(
            FactorRoute(slot.layer, slot.side, slot.dim, destination, decomposer)
            for slot, destination, decomposer in zip(
                self.costs.slots, self.destination, self.decomposer, strict=True
            )
        )
        world = tuple(range(self.costs.world_size))
        shares = []
        for source in world if len(world) > 1 else ():
            units = tuple((route.key,) for route in routes if route.decomposed_by == source)
            if units:
                shares.append(DecompositionShare(source, units, world))
        return Placement(
            self.costs.world_size,
            "hooks",
            routes,
            tuple(shares),
            buckets=tuple(tuple(bucket) for bucket in self.buckets),
        )
