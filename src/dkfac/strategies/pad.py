"""``strategy="pad"``: PAD-KFAC (placement-aware D-KFAC, Lin Zhang's thesis), docs/strategies.md.

An allreduce delivers every factor to every worker although only its owner decomposes it.
PAD-KFAC sends each factor with a *reduce* to its owner instead, launched from the hooks like
SPD-KFAC. Owners come from the optimal contiguous partition of the ready-ordered factor list
(A in forward order, G in reverse), minimising the largest per-owner cost (predicted
reduce + decomposition time), so consecutive factors of one owner travel in one fused reduce.
Only the owner averages, keeps and decomposes a factor; decompositions are broadcast fused and
every worker preconditions every layer.

Owners are fixed at setup (running averages live on them); profiling only re-plans how each
owner's contiguous block is split into buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

from dkfac.strategies.factor_placement import SlotCosts
from dkfac.strategies.pipelined import PipelinedStrategy
from dkfac.strategies.placement import plan_contiguous_partition


class PADStrategy(PipelinedStrategy):
    """PAD-KFAC: hook-launched fused reduces to contiguous-partition owners."""

    name = "pad"

    @staticmethod
    def plan_destinations(costs: SlotCosts) -> list[int | None]:
        """Owner of each slot: optimal contiguous partition of the ready order."""
        beta = 0.0 if costs.size_based else costs.cost.collective.beta  # sizes: d³ alone
        cost = [
            seconds + beta * nbytes
            for seconds, nbytes in zip(costs.decomposition_s, costs.wire, strict=True)
        ]
        return list(plan_contiguous_partition(cost, costs.world_size))

    @staticmethod
    def plan_decomposers(costs: SlotCosts, destination: Sequence[int | None]) -> list[int]:
        """The owner that received the factor decomposes it."""
        return [int(owner) for owner in destination if owner is not None]
