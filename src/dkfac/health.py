"""What went wrong in a run (numerically, or statistics left out), as ``health()`` reports it."""

from __future__ import annotations

from dataclasses import dataclass

from dkfac.curvature.layer import LayerHealth


@dataclass(frozen=True)
class Health:
    """What went wrong, as :meth:`KFACPreconditioner.health` reports it.

    Attributes:
        skipped_steps: factor-update steps whose gradients were not finite (a GradScaler
            skipped them): no factor or decomposition was changed.
        layers: per preconditioned layer, the counts of :class:`LayerHealth` on this worker.
        refused_statistics: statistics left out of their factor windows on this worker
            because the tensor held for them (``batched_statistics``) was changed in place
            (reported by an error at the next forward pass or ``step()``, one for all the
            refusals before it).
    """

    skipped_steps: int
    layers: dict[str, LayerHealth]
    refused_statistics: int = 0
