"""``strategy="kaisa"``: KAISA's gradient-worker fraction (Pauloski et al., SC21).

P workers form a ``(P/g) × g`` grid, ``g = grad_worker_fraction · P``: grid rows are the
*gradient-worker groups*, grid columns the *receiver groups*. Per step:

1. factor statistics are allreduced (sums weighted by rows/examples, symmetric factors packed,
   fused) and every worker keeps the global running factors;
2. each layer's owner (LPT over all workers on ``d_A³ + d_G³``) decomposes it and broadcasts the
   decomposition inside its grid row (fused, one bucket list per owner);
3. every worker of that row preconditions the layer; each of them broadcasts the result down
   its grid column, so every worker ends with every preconditioned gradient.

``g = P`` (fraction 1) is COMM-OPT, i.e. D-KFAC: decompositions go to everyone and no gradient
is sent. ``g = 1`` (fraction 1/P) is MEM-OPT: only the owner holds a layer's decomposition and it
broadcasts the preconditioned gradient to all.
"""

from __future__ import annotations

from collections.abc import Sequence

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.factor_side import decomposition_work
from dkfac.strategies.base import Strategy
from dkfac.strategies.placement import longest_processing_time
from dkfac.strategies.plan import (
    DecompositionShare,
    Placement,
    gradient_shares,
    layer_owner_routes,
)
from dkfac.strategies.plan_report import PlanReport
from dkfac.strategies.registry import KAISAOptions


def plan_layer_owners(dims: Sequence[tuple[int, int]], world_size: int) -> list[int]:
    """Owner of each layer: longest-processing-time on the decomposition cost ``d_A³ + d_G³``.

    Args:
        dims: ``(d_A, d_G)`` of each layer, in registration order.
        world_size: number of workers.
    """
    costs = [decomposition_work(a) + decomposition_work(g) for a, g in dims]
    return longest_processing_time(costs, world_size)


def grid(world_size: int, grad_workers: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows (gradient-worker groups) and columns (receiver groups) of the worker grid."""
    g = grad_workers
    rows = [list(range(r * g, (r + 1) * g)) for r in range(world_size // g)]
    columns = [list(range(c, world_size, g)) for c in range(g)]
    return rows, columns


def column_sources(owners: Sequence[int], grad_workers: int, column: int) -> list[int]:
    """Per layer, the rank of grid column ``column`` that preconditions it (in the owner's row)."""
    return [(owner // grad_workers) * grad_workers + column for owner in owners]


def kaisa_placement(
    dims: Sequence[tuple[int, int]], world_size: int, grad_workers: int
) -> Placement:
    """KAISA's plan with ``grad_workers`` gradient workers per layer (see the module docstring).

    Args:
        dims: ``(d_A, d_G)`` of each layer, in registration order.
        world_size: number of workers ``P``.
        grad_workers: ``f·P``, a divisor of ``P``.
    """
    owners = plan_layer_owners(dims, world_size)
    rows, columns = grid(world_size, grad_workers)
    decompositions = tuple(
        DecompositionShare(owner, tuple(((i, "a"), (i, "g")) for i in owned), tuple(row))
        for row in rows
        if len(row) > 1
        for owner in row
        if (owned := [i for i, o in enumerate(owners) if o == owner])
    )
    gradients = tuple(
        share
        for c, column in enumerate(columns)
        for share in gradient_shares(column_sources(owners, grad_workers, c), column)
    )
    return Placement(
        world_size, "step", layer_owner_routes(dims, owners), decompositions, gradients
    )


class KAISAStrategy(Strategy):
    """Gradient-worker fraction ``f``: decompositions shared by ``f·P`` workers per layer."""

    name = "kaisa"

    def __init__(self, comm: Communicator, recorder: StepRecorder, options: KAISAOptions) -> None:
        super().__init__(recorder, comm)
        self.grad_workers = options.grad_workers(comm.world_size)

    def place(self, dims: Sequence[tuple[int, int]]) -> Placement:
        """Owners by LPT on ``d_A³ + d_G³``; decompositions along rows, gradients down columns."""
        return kaisa_placement(dims, self.world_size, self.grad_workers)

    def plan(self) -> PlanReport:
        """Owner of each layer's factors; one fused allreduce of all factors at ``step()``."""
        report = super().plan()
        report["grad_workers"] = self.grad_workers
        return report
