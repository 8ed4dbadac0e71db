"""What went wrong numerically in a run, as ``KFACPreconditioner.health()`` reports it."""

from __future__ import annotations

from dataclasses import dataclass

from dkfac.curvature.layer import LayerHealth


@dataclass(frozen=True)
class Health:
    """What went wrong numerically, as :meth:`KFACPreconditioner.health` reports it.

    Attributes:
        skipped_steps: factor-update steps whose gradients were not finite (a GradScaler
            skipped them): no factor or decomposition was changed.
        layers: per preconditioned layer, the counts of :class:`LayerHealth` on this worker.
        refused_windows: factor windows whose statistics were dropped, not folded, because a
            tensor held for them (``batched_statistics``) was changed in place (the error was
            raised then).
    """

    skipped_steps: int
    layers: dict[str, LayerHealth]
    refused_windows: int = 0
