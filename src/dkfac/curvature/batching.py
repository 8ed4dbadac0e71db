"""Which of one worker's equal-shaped curvature work runs batched.

``KFACPreconditioner``'s ``batched_preconditioning``, ``batched_decompositions``,
``batched_factor_updates`` and ``batched_statistics``, resolved for its device.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

#: The widest factors a GPU decomposes batched by default (``batched_decompositions=None``).
#: ResNet-50's factors' Cholesky inverses by width on an H200 (``gpu_breakdown.py``'s
#: ``cholesky_inverse_by_size``, 2026-11-30, docs/benchmarks.md "The fifth GPU session"):
#: batched took 0.29 of one at a time's time at 64 wide (12 factors), 0.42 at 128, 0.25 at
#: 256, 0.45 at 512, then 1.51 at 576, 0.63 at 1024 (14), 1.33 at 1152, 1.49 at 2048,
#: 1.42 at 2304, 2.09 at 4608: batched pays up to 512, not reliably beyond. Eigendecompositions
#: were timed only whole-model (1.64 s batched against 1.67 one at a time).
CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM = 512


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
