"""Which of one worker's equal-shaped curvature work runs batched.

``KFACPreconditioner``'s ``batched_preconditioning``, ``batched_decompositions``,
``batched_factor_updates`` and ``batched_statistics``, resolved for its device.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

#: The widest factors a GPU decomposes batched by default (``batched_decompositions=None``):
#: none until per-width timings exist. The H200 data are whole-model totals only (ResNet-32's
#: factors, all at most 576 wide: Cholesky inverses 7.0 ms batched against 12.7 one at a
#: time; ResNet-50's, up to 4608: 0.136 s against 0.113); ``gpu_breakdown.py``'s
#: ``cholesky_inverse_by_size`` gives the per-width figures this is to be set from.
CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM = 0


@dataclass(frozen=True)
class Batching:
    """How one worker batches layers and factors of equal shapes.

    Attributes:
        preconditioning: equal-shaped layers preconditioned by batched products
            (:class:`~dkfac.curvature.layer_stacks.LayerStacks`).
        decompositions: equal-size factors up to this wide decomposed by batched calls
            (:func:`~dkfac.curvature.decomposition.decompose_factors`; 0: none).
        factor_updates: equal-shaped factors folded into their running averages by stacked
            operations (:func:`~dkfac.curvature.running_average.running_averages`).
        statistics: the statistics of equal-shaped layers' inputs and output gradients
            formed together (:mod:`dkfac.pending_statistics`).
    """

    preconditioning: bool = False
    decompositions: int = 0
    factor_updates: bool = False
    statistics: bool = False


def batched_decompositions_up_to(option: bool | int | None, device: torch.device) -> int:
    """The widest factors decomposed batched on ``device`` (0: none).

    ``option`` is ``batched_decompositions``: True (every size), False (none), a width, or
    None: up to :data:`CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM` on a GPU, none elsewhere.
    """
    if option is None:
        return CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM if device.type == "cuda" else 0
    if isinstance(option, bool):
        return sys.maxsize if option else 0
    return option
