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
from typing import Any

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.base import DistributedStrategy, layer_owner_factors
from dkfac.strategies.local import decompose_here, fold_here
from dkfac.strategies.placement import longest_processing_time


def predicted_layer_cost(a_dim: int, g_dim: int) -> float:
    """Relative cost of owning a layer: both decompositions plus preconditioning (see docs)."""
    return float(a_dim**3 + g_dim**3 + g_dim * a_dim * (g_dim + a_dim))


def plan_layer_owners(dims: Sequence[tuple[int, int]], world_size: int) -> list[int]:
    """Owner of each layer: longest-processing-time on :func:`predicted_layer_cost`.

    Args:
        dims: ``(d_A, d_G)`` of each layer, in registration order.
        world_size: number of workers.
    """
    return longest_processing_time([predicted_layer_cost(a, g) for a, g in dims], world_size)


class DPStrategy(DistributedStrategy):
    """DP-KFAC: owners build, decompose and apply their layers' factors; no factor traffic."""

    name = "dp"

    def __init__(self, comm: Communicator, recorder: StepRecorder) -> None:
        self.comm = comm
        self.recorder = recorder
        self.owner: dict[str, int] = {}
        self.dims: dict[str, tuple[int, int]] = {}

    def setup(self, layers: Sequence[LayerCurvature], *, accumulation_steps: int = 1) -> None:
        """Owners by longest-processing-time on :func:`predicted_layer_cost`."""
        dims = [(layer.block.a_dim, layer.block.g_dim) for layer in layers]
        owners = plan_layer_owners(dims, self.comm.world_size)
        self.owner = {layer.name: owner for layer, owner in zip(layers, owners, strict=True)}
        self.dims = {layer.name: (layer.block.a_dim, layer.block.g_dim) for layer in layers}

    def owns(self, layer: LayerCurvature) -> bool:
        """Whether this worker owns ``layer``."""
        return self.owner[layer.name] == self.comm.rank

    def captures(self, layer: LayerCurvature) -> bool:
        """Only the owner captures statistics."""
        return self.owns(layer)

    def holds_factors(self, layer: LayerCurvature) -> bool:
        """Only the owner keeps factors."""
        return self.owns(layer) and layer.a is not None

    def after_load(self, layers: Sequence[LayerCurvature]) -> None:
        """Forget loaded factors and decompositions of layers another worker owns."""
        for layer in layers:
            if not self.owns(layer):
                layer.a = layer.g = None
                layer.inverse = None

    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Fold the owner's local batch factors; nothing is sent."""
        owned = [layer for layer in layers if self.owns(layer)]
        fold_here(layers, owned, decay, loss_reduction, fold=fold)

    def update_inverses(
        self, layers: Sequence[LayerCurvature], damping: float, method: str, dtype: torch.dtype
    ) -> None:
        """Decompose the owned layers here."""
        owned = [layer for layer in layers if self.owns(layer)]
        decompose_here(self.recorder, owned, damping, method, dtype)

    def precondition(
        self, layers: Sequence[LayerCurvature], grads: Sequence[Tensor], damping: float
    ) -> list[Tensor]:
        """Owners precondition; each broadcasts its layers' directions in fused buckets."""
        sources = [self.owner[layer.name] for layer in layers]
        return self.precondition_and_broadcast(layers, grads, damping, sources)

    def plan(self) -> dict[str, Any]:
        """The owner of each layer (it captures, decomposes and preconditions it)."""
        factors = layer_owner_factors(self.dims, self.owner, "none (owner's shard only)")
        return {"strategy": self.name, "factors": factors, "buckets": []}
