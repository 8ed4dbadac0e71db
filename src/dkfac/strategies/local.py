"""``strategy="local"``: everything on this worker, no communication.

The reference every distributed strategy must reproduce on the concatenated global batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.decomposition import update_inverses
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.base import Strategy


def fold_here(
    layers: Sequence[LayerCurvature],
    folded: Sequence[LayerCurvature],
    decay: float,
    loss_reduction: str,
    *,
    fold: bool,
) -> None:
    """Fold the batch factors ``folded`` captured on this worker alone; clear every layer's.

    Each factor is folded when it has statistics: ``A`` when the layer's forward ran, ``G``
    when a gradient reached its output (docs/math.md, "Which statistics count"). ``fold``
    False (a step whose gradients were not finite) folds nothing and still clears.
    """
    if fold:
        for layer in folded:
            layer.fold_window(loss_reduction, decay)
    for layer in layers:
        layer.clear_statistics()


def decompose_here(
    recorder: StepRecorder,
    layers: Sequence[LayerCurvature],
    damping: float,
    method: str,
    dtype: torch.dtype,
) -> None:
    """Decompose the factors of ``layers`` on this worker (timed as ``inverse_compute``)."""
    with recorder.phase("inverse_compute"):
        update_inverses(layers, damping, method, dtype)


def precondition_here(
    recorder: StepRecorder,
    layers: Sequence[LayerCurvature],
    grads: Sequence[Tensor],
    damping: float,
) -> list[Tensor]:
    """Precondition every one of ``layers`` on this worker (timed as ``precondition``)."""
    with recorder.phase("precondition"):
        return [
            layer.precondition(grad, damping) for layer, grad in zip(layers, grads, strict=True)
        ]


class LocalStrategy(Strategy):
    """Single-worker K-FAC (or independent K-FAC per worker when run under DDP)."""

    name = "local"

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Fold each layer's batch factors into its running averages."""
        fold_here(layers, layers, decay, loss_reduction, fold=fold)

    def update_inverses(
        self, layers: Sequence[LayerCurvature], damping: float, method: str, dtype: torch.dtype
    ) -> None:
        """Decompose every layer's factors here."""
        decompose_here(self.recorder, layers, damping, method, dtype)

    def precondition(
        self, layers: Sequence[LayerCurvature], grads: Sequence[Tensor], damping: float
    ) -> list[Tensor]:
        """Precondition every layer here."""
        return precondition_here(self.recorder, layers, grads, damping)
