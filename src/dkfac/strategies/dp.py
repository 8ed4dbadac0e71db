"""``strategy="dp"``: DP-KFAC, distributed preconditioning (Zhang, Shi, Wang, Li, 2022).

docs/strategies.md. Every layer has one owner (longest-processing-time on its predicted cost:
decompositions ``d_A³ + d_G³`` plus preconditioning ``d_G·d_A·(d_G + d_A)``). Only the owner
captures the layer's ``a`` and ``g`` in the hooks; it builds ``A`` and ``G`` from **its own
local mini-batch**, keeps the running averages, decomposes them, preconditions the layer's
(already averaged) gradient and broadcasts the preconditioned gradient, fused per owner.
Factors are never communicated; a worker holds factors, decompositions and captured
activations only for the layers it owns.

Statistical difference: each layer's factors estimate the curvature from ``1/P`` of the global
batch (the owner's shard) instead of all of it, so a single batch factor is noisier; the
running average over steps smooths it (the authors report unchanged convergence). With
``P = 1`` it is exactly ``strategy="local"``.
"""

from __future__ import annotations

from collections.abc import Sequence

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.factor_side import decomposition_work, preconditioning_work
from dkfac.strategies.base import Strategy
from dkfac.strategies.placement import longest_processing_time
from dkfac.strategies.plan import Placement, gradient_shares, layer_owner_routes


def predicted_layer_cost(a_dim: int, g_dim: int) -> float:
    """Relative cost of owning a layer: both decompositions plus preconditioning (see docs)."""
    decompositions = decomposition_work(a_dim) + decomposition_work(g_dim)
    return decompositions + preconditioning_work(a_dim, g_dim)


def plan_layer_owners(dims: Sequence[tuple[int, int]], world_size: int) -> list[int]:
    """Owner of each layer: longest-processing-time on :func:`predicted_layer_cost`.

    Args:
        dims: ``(d_A, d_G)`` of each layer, in registration order.
        world_size: number of workers.
    """
    return longest_processing_time([predicted_layer_cost(a, g) for a, g in dims], world_size)


def dp_placement(dims: Sequence[tuple[int, int]], world_size: int) -> Placement:
    """DP-KFAC's plan: owners keep their shard's factors; gradients broadcast from owners."""
    owners = plan_layer_owners(dims, world_size)
    return Placement(
        world_size,
        "none",
        layer_owner_routes(dims, owners),
        gradients=gradient_shares(owners, tuple(range(world_size))),
    )


class DPStrategy(Strategy):
    """DP-KFAC: owners build, decompose and apply their layers' factors; no factor traffic."""

    name = "dp"

    def __init__(self, comm: Communicator, recorder: StepRecorder) -> None:
        super().__init__(recorder, comm)

    def place(self, dims: Sequence[tuple[int, int]]) -> Placement:
        """Owners by longest-processing-time on :func:`predicted_layer_cost`."""
        return dp_placement(dims, self.world_size)
