"""``strategy="pad"``: PAD-KFAC (placement-aware D-KFAC, Lin Zhang's thesis), ALGORITHMS.md §5.

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

from dkfac.distributed.pipelined import PipelinedStrategy
from dkfac.distributed.placement import plan_contiguous_partition


class PADStrategy(PipelinedStrategy):
    """PAD-KFAC: hook-launched fused reduces to contiguous-partition owners."""

    name = "pad"
    factors_everywhere = False

    def plan_destinations(self) -> list[int | None]:
        """Owner of each slot: optimal contiguous partition of the ready order."""
        assert self.cost is not None
        beta = self.cost.collective.beta
        costs = [
            seconds + beta * nbytes
            for seconds, nbytes in zip(self.decomposition_s, self.wire, strict=True)
        ]
        return list(plan_contiguous_partition(costs, self.comm.world_size))

    def plan_decomposers(self) -> list[int]:
        """The owner that received the factor decomposes it."""
        return [int(owner) for owner in self.destination if owner is not None]
