"""Math of one layer on one worker: factor statistics, decompositions, preconditioning.

Nothing in this package talks to other processes; everything is testable in float64.
"""

from dkfac.curvature.blocks import (
    Conv2dBlock,
    FactorStatistic,
    KroneckerBlock,
    LinearBlock,
    UnsupportedLayerError,
    make_block,
)
from dkfac.curvature.inverse import (
    EigenInverse,
    KroneckerInverse,
    TikhonovInverse,
    decompose,
    tikhonov_pi,
)
from dkfac.curvature.layer import LayerCurvature, update_inverses

__all__ = [
    "Conv2dBlock",
    "EigenInverse",
    "FactorStatistic",
    "KroneckerBlock",
    "KroneckerInverse",
    "LayerCurvature",
    "LinearBlock",
    "TikhonovInverse",
    "UnsupportedLayerError",
    "decompose",
    "make_block",
    "tikhonov_pi",
    "update_inverses",
]
