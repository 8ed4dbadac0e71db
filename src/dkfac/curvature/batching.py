"""Which of one worker's equal-shaped curvature work runs batched.

``KFACPreconditioner``'s ``batched_preconditioning`` and ``batched_decompositions``, resolved
for its device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batching:
    """How one worker batches layers and factors of equal shapes.

    Attributes:
        preconditioning: equal-shaped layers preconditioned by batched products
            (:class:`~dkfac.curvature.layer_stacks.LayerStacks`).
        decompositions: equal-size factors decomposed by batched calls
            (:func:`~dkfac.curvature.decomposition.decompose_factors`).
    """

    preconditioning: bool = False
    decompositions: bool = False
